"""`v4flash-pd render slurm` end to end on the real two-node localhost Slurm cluster (slurm_harness.py).

What runs is exactly what a user submits: the rendered sbatch script, one `srun --overlap` step per
box running `v4flash-pd up --box K --rehearse` on its node and the router step on the first node
(stand-in engines speaking SGLang's HTTP protocol, the real sglang-router binary). Both logical
nodes (n1, n2) share 127.0.0.1 and one network namespace, hence `--port-offset 100` and base ports
picked free per job. Nothing is mocked; every check reads what the job left: the router's /workers,
a /generate through it, the run dirs (state.json, *.pid), the processes in /proc, Slurm's job state.

Every job is stopped in teardown (`scancel --signal=TERM`, then a plain scancel, then SIGKILL by
verified pid-file identity), also when the test failed, so one failure cannot cascade into the next
test's ports or the session's cluster.

A clean stop sends every step SIGTERM twice (scancel's, then the script's fail-fast once the first
step ended): test_clean_stop_gives_a_slow_worker_its_grace checks that a worker still stopping keeps
its grace period (no SIGKILL) and the job still ends COMPLETED 0:0 (it used to end FAILED 143:0 in
about half the runs, and SIGKILL slow workers, before the supervisor ignored repeated SIGTERMs).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.slurm_harness import FINAL_STATES, PROJECT_PORTS, SlurmCluster, SlurmHarnessError
from v4flash_pd.httpclient import request
from v4flash_pd.procgroup import Identity, parse_pid_file, read_stat
from v4flash_pd.readiness import smoke_text, worker_counts

# The venv's bin dir: `v4flash-pd` and the router must resolve on the nodes through the job's PATH.
VENV_BIN = Path(sys.executable).parent
PORT_OFFSET = 100
# Base ports relative to a per-job base B: slot s of box k = B + field + s + k x PORT_OFFSET.
HTTP, BOOTSTRAP, NCCL, ROUTER, METRICS = 0, 10, 20, 40, 41
SLOTS_PER_BOX = 2
BOXES = 2
READY_TIMEOUT = 90.0
STOP_TIMEOUT = 60.0
GRACE = 5  # the supervisor's default grace is 30 s; the fail-fast bound below relies on a short one

_used_bases: set[int] = set()


def _job_ports(base: int) -> list[int]:
    ports = [base + ROUTER, base + METRICS]
    for k in range(BOXES):
        for field_ in (HTTP, BOOTSTRAP, NCCL):
            ports += [base + field_ + s + k * PORT_OFFSET for s in range(SLOTS_PER_BOX)]
    return ports


def _bindable(port: int) -> bool:
    # No SO_REUSEADDR: a port with a lingering TIME_WAIT connection counts as taken.
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _pick_base() -> int:
    """A base port whose whole layout is free, below the kernel's ephemeral range (32768+) so an
    outgoing connection cannot take one between the check and the bind, away from the project's
    fixed ports and from the bases earlier tests in this session used (TIME_WAIT, stragglers)."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        base = rng.randrange(20000, 28600, 200)
        ports = _job_ports(base)
        if base in _used_bases or any(p in PROJECT_PORTS for p in ports):
            continue
        if all(_bindable(p) for p in ports):
            _used_bases.add(base)
            return base
    raise AssertionError("no free port range for a cluster job in 20000-28800")


def _alive(ident: Identity) -> bool:
    """The recorded process still exists (same pid and start time) and has not exited."""
    st = read_stat(ident.pid)
    return st is not None and st.start_time == ident.start_time and st.state not in ("Z", "X")


def _proc_text(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class PdJob:
    cluster: SlurmCluster
    dir: Path  # the submit dir (sbatch's cwd): script, cluster-plan.json, job output, v4flash-runs/
    jobid: int
    base: int
    prefill: int
    decode: int

    # ---------------------------------------------------------------- where things are

    @property
    def runs(self) -> Path:
        return self.dir / "v4flash-runs" / str(self.jobid)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.base + ROUTER}"

    def output(self) -> str:
        path = self.dir / f"v4flash-pd-{self.jobid}.out"
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def state_json(self, part: str) -> dict:
        try:
            return json.loads((self.runs / part / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def plan_slots(self) -> list[dict]:
        return json.loads((self.dir / "cluster-plan.json").read_text())["slots"]

    def names_on_box(self, box: int) -> set[str]:
        return {s["name"] for s in self.plan_slots() if s["box"] == box}

    def identities(self) -> dict[str, Identity]:
        """Every process a run dir of this job recorded: '<part>/<name>' -> identity (launchers included)."""
        out: dict[str, Identity] = {}
        for f in sorted(self.runs.glob("*/*.pid")):
            try:
                ident = parse_pid_file(f.read_text())
            except OSError:
                continue
            assert ident is not None, f"{f} is not a valid pid file: {f.read_text()!r}"
            out[f"{f.parent.name}/{f.stem}"] = ident
        return out

    def stray_pids(self) -> dict[int, str]:
        """Processes anywhere on this host that belong to this job: a run dir of ours in the
        environment (V4FLASH_RUN_DIR, set for every engine and router) or our submit dir on the
        command line (srun clients, `up`). By /proc scan, never by name. The router retitles itself
        (setproctitle blanks its environ), so it is found by its pid file (identities) instead."""
        needle_env = f"V4FLASH_RUN_DIR={self.runs}"
        needle_cmd = str(self.dir)
        own = {os.getpid(), os.getppid()}
        found: dict[int, str] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in own:
                continue
            pid = int(entry)
            st = read_stat(pid)
            if st is None or st.state in ("Z", "X"):
                continue
            cmd = _proc_text(pid, "cmdline")
            if needle_cmd in cmd or needle_env in _proc_text(pid, "environ"):
                found[pid] = cmd[:200]
        return found

    def leftovers(self) -> list[str]:
        alive = [f"{name} pid {ident.pid}" for name, ident in self.identities().items() if _alive(ident)]
        alive += [f"pid {pid}: {cmd}" for pid, cmd in sorted(self.stray_pids().items())]
        return alive

    def describe(self) -> str:
        """What a failure message needs: Slurm's view, the job output, the run dirs' states and log tails."""
        parts = []
        try:
            info = self.cluster.show_job(self.jobid)
            parts.append(f"job {self.jobid}: {info.get('JobState')} exit {info.get('ExitCode')} "
                         f"reason {info.get('Reason')}")
        except SlurmHarnessError as e:
            parts.append(f"job {self.jobid}: {e}")
        parts.append(f"--- job output ---\n{self.output()[-4000:]}")
        if self.runs.is_dir():
            for d in sorted(p for p in self.runs.iterdir() if p.is_dir()):
                st = self.state_json(d.name)
                parts.append(f"--- {d.name}: status {st.get('status')!r} reason {st.get('reason')!r}")
                for log in sorted(d.glob("*.log")):
                    parts.append(f"    {log.name}: ...{log.read_text(errors='replace')[-800:]}")
        return "\n".join(parts)

    # ---------------------------------------------------------------- waiting

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> float:
        """Bounded wait for the router's READY (its state.json and the `READY http` line) and every
        box's `READY box K of N` line; seconds taken."""
        t0 = time.monotonic()
        while True:
            out = self.output()
            # state.json turns ready a moment before the READY line reaches the job output (srun
            # forwards it): wait for both, the line is what a user's script would wait for.
            router_ready = self.state_json("router").get("status") == "ready" and "READY http" in out
            boxes_ready = all(f"READY box {k} of {BOXES}" in out for k in range(BOXES))
            if router_ready and boxes_ready:
                return time.monotonic() - t0
            state = self.cluster.state(self.jobid)
            if state in FINAL_STATES:
                raise AssertionError(f"job ended {state} before READY\n{self.describe()}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"no READY within {timeout:.0f} s\n{self.describe()}")
            time.sleep(0.25)

    def wait_final(self, timeout: float) -> str:
        t0 = time.monotonic()
        while True:
            state = self.cluster.state(self.jobid)
            if state in FINAL_STATES:
                return state
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"job still {state} after {timeout:.0f} s\n{self.describe()}")
            time.sleep(0.2)

    def wait_no_leftovers(self, timeout: float = 10.0) -> list[str]:
        """Bounded: a process may need a moment to be reaped after the job is final."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    # ---------------------------------------------------------------- stopping (teardown)

    def cleanup(self) -> list[str]:
        """Stop the job whatever state the test left it in; SIGKILL what survives, by verified
        identity from the pid files. Returns what had to be killed (empty when the job stopped)."""
        try:
            if self.cluster.state(self.jobid) not in FINAL_STATES:
                self.cluster.scancel(self.jobid, signal="TERM")
                try:
                    self.wait_final(30)
                except AssertionError:
                    self.cluster.scancel(self.jobid)
                    self.wait_final(30)
        except (SlurmHarnessError, AssertionError, subprocess.TimeoutExpired):
            pass  # the pid-file sweep below still runs
        killed = []
        for name, ident in self.identities().items():
            if _alive(ident):
                try:
                    os.killpg(ident.pid, signal.SIGKILL)  # each engine/router leads its own session
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    os.kill(ident.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                killed.append(f"{name} pid {ident.pid}")
        return killed


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's environment without V4FLASH_* and with the venv first on PATH; sbatch passes
    it on to the job (--export=ALL), so the nodes run the project's `v4flash-pd` and router."""
    for key in [k for k in os.environ if k.startswith("V4FLASH_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return dict(os.environ)


def _render(out: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(VENV_BIN / "v4flash-pd"), "render", "slurm", "-o", str(out), *args],
                          cwd=out.parent, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"render slurm exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _render_args(base: int, prefill: int, decode: int, sets: tuple[str, ...] = ()) -> list[str]:
    extra = [a for kv in sets for a in ("--set", kv)]
    return [*extra, "--boxes", str(BOXES), "--prefill", str(prefill), "--decode", str(decode),
            "--port-offset", str(PORT_OFFSET), "--rehearse", "--container", "none",
            "--set", f"router.port={base + ROUTER}", "--set", f"router.metrics_port={base + METRICS}",
            "--set", f"cluster.http_port={base + HTTP}", "--set", f"cluster.bootstrap_port={base + BOOTSTRAP}",
            "--set", f"cluster.nccl_port={base + NCCL}", "--set", f"grace_period={GRACE}"]


@pytest.fixture
def submit(slurm_cluster: SlurmCluster, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., PdJob]]:
    """submit(prefill, decode, *sets) renders a rehearsal cluster plan on free ports and sbatches it;
    every job submitted is stopped at teardown, also when the test failed."""
    env = _clean_env(monkeypatch)
    jobs: list[PdJob] = []

    def _submit(prefill: int, decode: int, *sets: str) -> PdJob:
        d = tmp_path / f"job{len(jobs)}"
        d.mkdir()
        base = _pick_base()
        _render(d / "job.sbatch", env, *_render_args(base, prefill, decode, sets))
        jobid = slurm_cluster.sbatch(d / "job.sbatch", d)
        job = PdJob(slurm_cluster, d, jobid, base, prefill, decode)
        jobs.append(job)
        return job

    yield _submit
    problems = []
    for job in jobs:
        killed = job.cleanup()
        if killed:
            problems.append(f"job {job.jobid}: had to SIGKILL {killed}")
    if problems:
        pytest.fail("teardown found live processes: " + "; ".join(problems))


# -------------------------------------------------------------------- shared checks


def _check_serving(job: PdJob) -> None:
    """READY lines, /workers counts, placement per box and node, a /generate through the router."""
    out = job.output()
    for k in range(BOXES):
        assert f"READY box {k} of {BOXES}" in out, job.describe()
    assert "READY http" in out, job.describe()

    rep = request(f"{job.router_url}/workers", timeout=10)
    counts = worker_counts(rep)
    assert counts == {"prefill": job.prefill, "decode": job.decode}, f"{rep.status} {rep.body[:2000]}"

    nodes = job.cluster.nodes  # box k runs on the job's k-th node: n1, n2
    for k in range(BOXES):
        names = job.names_on_box(k)
        box_dir = job.runs / f"box{k}"
        assert box_dir.is_dir(), job.describe()
        st = job.state_json(f"box{k}")
        assert st.get("status") == "ready", (k, st.get("status"), job.describe())
        assert set(st.get("procs") or {}) == names, (k, st.get("procs"), names)
        for name in names:
            assert (box_dir / f"{name}.log").is_file() and (box_dir / f"{name}.pid").is_file(), name
            ident = parse_pid_file((box_dir / f"{name}.pid").read_text())
            assert ident is not None and _alive(ident), f"{name}: {ident}"
            # The engine inherits its step's environment: it ran on box k's node, in this job.
            environ = _proc_text(ident.pid, "environ").split()
            assert f"SLURMD_NODENAME={nodes[k]}" in environ, (name, [e for e in environ if e.startswith("SLURM")])
            assert f"SLURM_JOB_ID={job.jobid}" in environ, name
            assert "v4flash_pd.rehearsal.engine" in _proc_text(ident.pid, "cmdline"), name
    router = parse_pid_file((job.runs / "router" / "router.pid").read_text())
    assert router is not None and _alive(router)
    # The router retitles itself (sglang::router), which blanks its /proc environ: ask its launcher.
    launcher = parse_pid_file((job.runs / "router" / "launcher.pid").read_text())
    assert launcher is not None and _alive(launcher)
    assert f"SLURMD_NODENAME={nodes[0]}" in _proc_text(launcher.pid, "environ").split()

    # Slurm's own view of the steps: box0 and the router on n1, box1 on n2.
    steps = job.cluster.run(["squeue", "-h", "-s", "-j", str(job.jobid), "-o", "%j %N"]).stdout.split("\n")
    placed = dict(line.split() for line in steps if len(line.split()) == 2)
    assert placed.get("box0") == nodes[0] and placed.get("box1") == nodes[1] and placed.get("router") == nodes[0], steps

    reply = request(f"{job.router_url}/generate",
                    {"text": "Say hello", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}, timeout=30)
    text, why = smoke_text(reply)
    assert text, f"/generate through the router: {why}"


def _check_clean_stop(job: PdJob) -> float:
    """scancel --signal=TERM -> COMPLETED, exit 0:0, every run dir stopped, nothing left running."""
    t0 = time.monotonic()
    job.cluster.scancel(job.jobid, signal="TERM")
    state = job.wait_final(STOP_TIMEOUT)
    took = time.monotonic() - t0
    exit_code = job.cluster.exit_code(job.jobid)
    left = job.wait_no_leftovers()
    assert not left, f"still running after the job ended {state} ({exit_code}): {left}"
    assert state == "COMPLETED", job.describe()
    assert exit_code == "0:0", job.describe()
    for part in [f"box{k}" for k in range(BOXES)] + ["router"]:
        st = job.state_json(part)
        assert st.get("status") == "stopped", (part, st.get("status"), st.get("reason"), job.describe())
    assert "every step stopped (exit 0)" in job.output(), job.describe()
    return took


# -------------------------------------------------------------------- the tests


@pytest.mark.timeout(150)
def test_1p1d_two_nodes_serves_and_stops_cleanly(submit: Callable[..., PdJob]) -> None:
    job = submit(1, 1)
    job.wait_ready()
    assert job.names_on_box(0) == {"prefill-0"} and job.names_on_box(1) == {"decode-0"}
    _check_serving(job)
    _check_clean_stop(job)


@pytest.mark.timeout(150)
def test_2p2d_two_nodes_serves_and_stops_cleanly(submit: Callable[..., PdJob]) -> None:
    job = submit(2, 2)
    job.wait_ready()
    # Slot-major placement: one prefill (NUMA slot 0) and one decode (slot 1) on every box.
    assert job.names_on_box(0) == {"prefill-0", "decode-0"}, job.plan_slots()
    assert job.names_on_box(1) == {"prefill-1", "decode-1"}, job.plan_slots()
    _check_serving(job)
    _check_clean_stop(job)


@pytest.mark.timeout(150)
def test_killed_decode_engine_fails_the_job_fast(submit: Callable[..., PdJob]) -> None:
    job = submit(1, 1)
    job.wait_ready()
    ident = parse_pid_file((job.runs / "box1" / "decode-0.pid").read_text())
    assert ident is not None and _alive(ident), ident
    assert "v4flash_pd.rehearsal.engine" in _proc_text(ident.pid, "cmdline")
    t0 = time.monotonic()
    os.kill(ident.pid, signal.SIGKILL)
    state = job.wait_final(60)
    took = time.monotonic() - t0
    assert state == "FAILED", job.describe()
    assert took < 60, took
    out = job.output()
    assert "stopping the others (fail fast)" in out, job.describe()
    # The job exits with the first non-zero step code: box1's `up` (on n2), as srun reported it.
    m = re.search(rf"srun: error: {job.cluster.nodes[1]}: task 0: Exited with exit code (\d+)", out)
    assert m is not None and m.group(1) != "0", job.describe()
    assert job.cluster.exit_code(job.jobid) == f"{m.group(1)}:0", job.describe()
    assert job.state_json("box1").get("status") == "failed", job.describe()
    left = job.wait_no_leftovers()
    assert not left, f"still running after the job FAILED: {left}"


@pytest.mark.timeout(150)
def test_clean_stop_gives_a_slow_worker_its_grace(submit: Callable[..., PdJob]) -> None:
    """A real SGLang worker takes seconds to stop; the stand-in's stop delay plays that for prefill
    (2 s, well inside grace_period), decode stops at once. A clean stop must wait for the slow one
    (SIGTERM, no SIGKILL anywhere) and end COMPLETED."""
    job = submit(1, 1, "prefill.0.env.V4FLASH_REHEARSAL_STOP_DELAY_S=2")
    job.wait_ready()
    _check_clean_stop(job)
    killed = []
    for events in sorted(job.runs.glob("*/events.jsonl")):
        for line in events.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "sigkill":
                killed.append(f"{events.parent.name}/{ev.get('name')}")
    assert not killed, f"a clean stop SIGKILLed {killed} (grace_period={GRACE}s)\n{job.describe()}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("container", ["none", "pyxis", "apptainer"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 2)])
def test_rendered_script_parses_with_bash_n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            container: str, shape: tuple[int, int]) -> None:
    env = _clean_env(monkeypatch)
    args = _render_args(27000, *shape)
    args[args.index("--container") + 1] = container
    if container != "none":
        args += ["--image", "/shared/v4flash-pd.sqsh" if container == "pyxis" else "/shared/v4flash-pd.sif"]
    out = tmp_path / "job.sbatch"
    _render(out, env, *args)
    assert (tmp_path / "cluster-plan.json").is_file()
    text = out.read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=2" in text
    proc = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
