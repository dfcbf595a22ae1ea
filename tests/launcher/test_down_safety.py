"""`down` on runs that went wrong in ways a hostile run found (issue 23): a process group whose leader
has exited but still has members (ours, or a stranger that inherited the recorded pid as its group
id), and a launcher that is stopped (SIGSTOP) or does not stop. Real processes, real signals; every
process a test starts is stopped by its pid."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fakebox
import pytest

from v4flash_pd.procgroup import identify

pytestmark = pytest.mark.timeout(120)

PY = sys.executable
# The leader forks a child that execs `sleep` (stdout wherever the leader's is), prints the child's
# pid, and exits once told to: the child is then a member of a group whose leader has exited.
LEADER = """
import os, sys
r, w = os.pipe()
child = os.fork()
if child == 0:
    if sys.argv[1] == "stranger":  # a daemon: its own stdio, none of the run's environment
        fd = os.open(os.devnull, os.O_RDWR)
        for n in (0, 1, 2):
            os.dup2(fd, n)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    else:
        env = dict(os.environ)
    os.execvpe("sleep", ["sleep", "60"], env)
print(child, flush=True)
sys.stdin.readline()
"""



def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _down(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "v4flash_pd", "down", "--run-dir", str(run), *args], capture_output=True, text=True,
                          env=fakebox.clean_env(), timeout=90)


def _orphaned_group(run: Path, kind: str) -> tuple[dict, int]:
    """A recorded role whose leader exited, leaving one member: (its identity record, the member's pid)."""
    argv = [PY, "-c", LEADER, kind]
    env = dict(fakebox.clean_env(), V4FLASH_RUN_DIR=str(run))
    with open(run / "prefill-0.log", "a") as log:
        leader = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                  start_new_session=True)
    member = int(leader.stdout.readline())
    ident = identify(leader.pid, argv)
    assert ident is not None
    record = {**ident.to_dict(), "marker": str(run)}  # what the supervisor records for a role it started
    leader.stdin.write("\n")
    leader.stdin.close()
    leader.wait(10)
    return record, member


def _run_dir(tmp: Path) -> Path:
    run = tmp / "run"
    (run / "patch").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"processes": []}))
    return run


def _record(run: Path, procs: dict, **state: object) -> None:
    (run / "state.json").write_text(json.dumps({"status": "stopped", "procs": procs, **state}))


def test_down_does_not_signal_a_stranger_in_an_exited_leaders_group(tmp_path: Path) -> None:
    """A daemon that is not ours sits in the recorded group (its leader has exited): `down` must not
    kill it, and must say why it did not."""
    run = _run_dir(tmp_path)
    record, member = _orphaned_group(run, "stranger")
    try:
        _record(run, {"prefill-0": record})
        res = _down(run, "--grace", "1")
        time.sleep(0.3)
        assert _alive(member), f"down killed a process this run did not start:\n{res.stdout}{res.stderr}"
        assert "Traceback" not in res.stderr
        assert "prefill-0 not signalled" in res.stdout and f"pid {member}" in res.stdout, res.stdout
    finally:
        _kill(member)


def test_down_still_stops_our_own_orphan_in_an_exited_leaders_group(tmp_path: Path) -> None:
    """A worker's child (SGLang's TP schedulers) left behind when the worker died: ours, stopped."""
    run = _run_dir(tmp_path)
    record, member = _orphaned_group(run, "ours")
    try:
        _record(run, {"prefill-0": record})
        res = _down(run, "--grace", "1")
        assert res.returncode == 0, res.stdout + res.stderr
        fakebox.wait_for(lambda: not _alive(member), 10, "our orphan to be stopped")
        assert "stopped leftover process groups: prefill-0" in res.stdout, res.stdout
    finally:
        _kill(member)


def _lock_free(run: Path) -> bool:
    fd = os.open(run / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_down_resumes_a_stopped_launcher_so_it_stops_the_run_and_frees_the_lock(tmp_path: Path) -> None:
    """`down --timeout` on a SIGSTOPped launcher exited 0 and left it stopped, holding the run dir's lock."""
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    topo = fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)
    env = dict(fakebox.clean_env(), V4FLASH_RUNS_ROOT=str(tmp_path / "runs"), V4FLASH_REHEARSAL_LOAD_SECONDS="0.3",
               V4FLASH_GRACE="5")
    run = tmp_path / "runs" / "r1"
    up = subprocess.run([PY, "-m", "v4flash_pd", "up", "--rehearse", "--detach", "--config", str(cfg), "--topology",
                         str(topo), "--run-dir", str(run)], capture_output=True, text=True, env=env, timeout=90)
    assert up.returncode == 0, up.stdout + up.stderr
    st = json.loads((run / "state.json").read_text())
    launcher, pids = int(st["launcher_pid"]), {k: int(v) for k, v in st["pids"].items()}
    try:
        os.kill(launcher, signal.SIGSTOP)
        res = _down(run, "--timeout", "10")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "launcher stopped the run" in res.stdout, res.stdout
        fakebox.wait_for(lambda: not _alive(launcher), 10, "the launcher to exit")
        for name, pid in pids.items():
            fakebox.wait_for(lambda pid=pid: not _alive(pid), 10, f"{name} to exit")
        assert _lock_free(run), "the run dir is still locked"
        assert json.loads((run / "state.json").read_text())["status"] == "stopped"
    finally:
        for pid in [launcher, *pids.values()]:
            _kill(pid)


def test_down_says_when_the_launcher_outlives_its_timeout(tmp_path: Path) -> None:
    """A launcher that does not stop in time (here: it ignores SIGTERM) still holds the run: exit 1, say so."""
    run = _run_dir(tmp_path)
    stubborn = subprocess.Popen([PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('ok', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout.readline().strip() == "ok"
        ident = identify(stubborn.pid)
        assert ident is not None
        _record(run, {}, status="ready", launcher=ident.to_dict(), launcher_pid=stubborn.pid)
        res = _down(run, "--timeout", "1")
        assert res.returncode == 1, res.stdout + res.stderr
        assert stubborn.poll() is None
        assert f"launcher (pid {stubborn.pid}) is still running" in res.stdout, res.stdout
        assert "Traceback" not in res.stderr
    finally:
        stubborn.kill()
        stubborn.wait(10)
