"""The real-Slurm harness works the way the launcher's Slurm mode will rely on it: batch jobs run and
report their exit status, a two-node exclusive GPU job runs one concurrent step per node, and a
signal sent with `scancel --signal` reaches the step's task (where a trap can act on it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.slurm_harness import FINAL_STATES, SlurmCluster

pytestmark = pytest.mark.timeout(120)


def _wait_file(path: Path, timeout: float) -> str:
    """Bounded wait for a file a job writes; its text."""
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} not written within {timeout:.0f} s")
        time.sleep(0.1)
    return path.read_text()


def _job_output(cwd: Path) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()}" for p in sorted(cwd.glob("*.out")))


def test_nodes_idle_with_gpus(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %t %c %G"]).stdout.split("\n")
    rows = sorted(line.split() for line in out if line.strip())
    assert rows == [["n1", "idle", "4", "gpu:8"], ["n2", "idle", "4", "gpu:8"]], out


def test_wrap_hostname_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    jobid = slurm_cluster.sbatch(None, tmp_path, args=["--wrap", "hostname"])
    state = slurm_cluster.wait_state(jobid, FINAL_STATES, timeout=30)
    assert state == "COMPLETED", _job_output(tmp_path)
    assert slurm_cluster.exit_code(jobid) == "0:0"
    assert (tmp_path / f"slurm-{jobid}.out").read_text().strip(), "hostname printed nothing"


def test_failing_job_is_failed(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/bash\necho about to fail\nexit 3\n")
    jobid = slurm_cluster.sbatch(script, tmp_path)
    assert slurm_cluster.wait_state(jobid, FINAL_STATES, timeout=30) == "FAILED"
    assert slurm_cluster.exit_code(jobid) == "3:0"


# Each step marks itself started, then waits (bounded) for the other node's step: if Slurm ran the two
# steps one after the other, the first would time out and exit 1, failing the job.
TWO_NODE_SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --gres=gpu:8
#SBATCH --output=job.out
set -u
for node in n1 n2; do
  srun --overlap -N1 -n1 -w "$node" bash -c '
    other=$([ "$SLURMD_NODENAME" = n1 ] && echo n2 || echo n1)
    date +%s.%N > "started-$SLURMD_NODENAME"
    echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES" > "step-$SLURMD_NODENAME.txt"
    for _ in $(seq 150); do [ -e "started-$other" ] && exit 0; sleep 0.1; done
    echo "step on $SLURMD_NODENAME never saw the step on $other" >&2; exit 1
  ' &
done
wait -n; rc1=$?
wait -n; rc2=$?
echo "steps exited $rc1 $rc2"
exit $(( rc1 || rc2 ))
"""


def test_two_concurrent_steps_one_per_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "two_node.sh"
    script.write_text(TWO_NODE_SCRIPT)
    jobid = slurm_cluster.sbatch(script, tmp_path)
    state = slurm_cluster.wait_state(jobid, FINAL_STATES, timeout=40)
    assert state == "COMPLETED", _job_output(tmp_path)
    lines = sorted((tmp_path / f"step-{n}.txt").read_text().strip() for n in slurm_cluster.nodes)
    # Each step sees its own node name and the GPUs of its node (the step inherits the job's gpu:8).
    assert [line.split()[0] for line in lines] == ["n1", "n2"], lines
    for line in lines:
        fields = line.split()
        assert len(fields) == 2 and fields[1] == "0,1,2,3,4,5,6,7", lines
    starts = [float((tmp_path / f"started-{n}").read_text()) for n in slurm_cluster.nodes]
    assert abs(starts[0] - starts[1]) < 10, starts


TERM_SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --output=job.out
srun -n1 bash -c '
  trap "echo TERM-received > term.marker; exit 0" TERM
  echo $$ > step.ready
  sleep 300 & wait $!
  echo "sleep ended without TERM" > term.marker; exit 1
'
echo "step-rc=$?" > batch.done
"""


def test_scancel_term_reaches_step_task(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "term.sh"
    script.write_text(TERM_SCRIPT)
    jobid = slurm_cluster.sbatch(script, tmp_path)
    slurm_cluster.wait_state(jobid, {"RUNNING"}, timeout=30)
    _wait_file(tmp_path / "step.ready", timeout=30)
    slurm_cluster.scancel(jobid, signal="TERM")
    assert _wait_file(tmp_path / "term.marker", timeout=20).strip() == "TERM-received"
    state = slurm_cluster.wait_state(jobid, FINAL_STATES, timeout=30)
    # --signal without --full spares the batch shell: it saw the step exit 0 (the trap's) and went on.
    assert _wait_file(tmp_path / "batch.done", timeout=5).strip() == "step-rc=0", _job_output(tmp_path)
    assert state == "COMPLETED", _job_output(tmp_path)
    assert slurm_cluster.exit_code(jobid) == "0:0"
