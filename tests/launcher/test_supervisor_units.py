"""Supervisor parts without real sleeps: the watchdog, the readiness gate, the stop order and the
identity checks run on a fake clock and a recording kill seam; where a real process is the point
(identity, signalling, stop under write failures) it is a real subprocess on this machine."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakebox import group_alive

from v4flash_pd.errors import RuntimeFailure
from v4flash_pd.hostprobe import Binding
from v4flash_pd.httpclient import ERROR, OK, REFUSED, TIMEOUT, Reply
from v4flash_pd.plan import Plan, ProcessSpec
from v4flash_pd.poll import Clock, poll_until
from v4flash_pd.procgroup import (
    Child,
    Identity,
    ProcessGroup,
    Signaller,
    Verdict,
    identify,
    parse_pid_file,
    pid_file_text,
    verify,
)
from v4flash_pd.readiness import HealthGate, describe
from v4flash_pd.rundir import RunDir
from v4flash_pd.supervisor import Supervisor
from v4flash_pd.watchdog import Watchdog

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s

    @property
    def clock(self) -> Clock:
        return Clock(self.now, self.sleep)


# ------------------------------------------------------------------ poll_until


def test_poll_until_gives_up_at_its_deadline_without_real_sleeping() -> None:
    fc = FakeClock()
    calls = []
    t0 = time.monotonic()
    assert poll_until(lambda: calls.append(1), 5.0, 0.5, fc.clock) is None
    assert time.monotonic() - t0 < 0.5
    assert fc.t == pytest.approx(1005.0)
    assert len(calls) == 11  # t=0, 0.5, ..., 5.0: the last sleep is cut to the deadline, one final check


def test_poll_until_returns_the_first_truthy_value() -> None:
    fc = FakeClock()
    seq = iter([None, 0, "", "got it", "later"])
    assert poll_until(lambda: next(seq), 10.0, 1.0, fc.clock) == "got it"
    assert fc.t == pytest.approx(1003.0)


# ------------------------------------------------------------------ watchdog


def _drive(dog: Watchdog, fc: FakeClock, answering: Any, until: float, tick: float = 0.05) -> float | None:
    """Run probes on the fake clock until a hang or `until`; return the hang time. A probe gets its
    answer as soon as the peer answers again (`answering(now)`) within its timeout, as a queued
    connection to a resumed process does."""
    while fc.t < until:
        for name, _url, timeout in dog.due(fc.t):
            started = fc.t
            end = started + timeout
            ok = False
            while fc.t < end and not ok:
                ok = answering(fc.t)
                if not ok:
                    fc.t = min(end, fc.t + 0.05)
            dog.observe(name, ok, started, fc.t)
        if dog.hung(fc.t):
            return fc.t
        fc.sleep(tick)
    return None


def test_watchdog_declares_a_silent_process_hung_within_its_window() -> None:
    fc = FakeClock()
    dog = Watchdog(window=6.0)
    dog.add("decode-0", "http://x/health", fc.t)
    hang_at = 1010.0
    found = _drive(dog, fc, lambda now: now < hang_at, until=1040.0)
    assert found is not None, "a process silent for 30 s was never declared hung"
    assert hang_at + 6.0 - dog.interval <= found <= hang_at + 6.0 + 0.1, found
    (h,) = dog.hung(found)
    assert h.name == "decode-0" and h.misses >= 2 and h.silent_for >= 6.0


def test_watchdog_tolerates_one_slow_answer_and_a_short_stall() -> None:
    fc = FakeClock()
    dog = Watchdog(window=6.0)
    dog.add("router", "http://x/liveness", fc.t)
    # silent for 4 s (less than the window) twice, healthy otherwise
    silent = [(1005.0, 1009.0), (1020.0, 1024.0)]
    found = _drive(dog, fc, lambda now: not any(a <= now < b for a, b in silent), until=1040.0)
    assert found is None


def test_watchdog_needs_several_misses_not_just_elapsed_time() -> None:
    fc = FakeClock()
    dog = Watchdog(window=3.0, min_misses=2)
    dog.add("p", "u", fc.t)
    (due,) = dog.due(fc.t)
    assert due[2] <= 1.0 + 1e-9  # probe timeout at most window/3
    fc.t += 10.0  # the supervisor was suspended (laptop lid): no probe failed yet
    assert dog.hung(fc.t) == []
    dog.observe("p", False, fc.t, fc.t)
    assert dog.hung(fc.t) == []
    dog.observe("p", False, fc.t, fc.t)
    assert [h.name for h in dog.hung(fc.t)] == ["p"]


# ------------------------------------------------------------------ readiness gate


def test_a_hung_worker_is_not_reported_as_not_listening() -> None:
    assert describe(Reply(0, "", "refused", REFUSED)) == "not listening yet"
    assert describe(Reply(0, "", "timed out", TIMEOUT), timeout=5).startswith("not answering")
    assert describe(Reply(0, "", "", TIMEOUT), "stopped by a signal (SIGSTOP/SIGTSTP)").startswith(
        "not answering (stopped by a signal")
    assert describe(Reply(503, "loading", "", OK)) == "loading (HTTP 503)"
    assert describe(Reply(0, "", "reset", ERROR)) == "no answer (reset)"
    gate = HealthGate(("prefill-0", "decode-0"))
    assert gate.observe("prefill-0", Reply(200, "ok")) is True
    assert gate.observe("decode-0", Reply(0, "", "timed out", TIMEOUT), timeout=5) is False
    assert not gate.done()
    assert gate.detail().startswith("decode-0 not answering")


# ------------------------------------------------------------------ supervise: hang -> fail fast


def _spec(name: str, role: str, url: str, argv: tuple[str, ...] = ("true",)) -> ProcessSpec:
    return ProcessSpec(name=name, role=role, argv=argv, env=(), gpus=(), binding=Binding(None, "none"),
                       ports=(), health_url=url)


def _plan(*specs: ProcessSpec) -> Plan:
    return Plan(profile="t", mode="pd", rehearse=True, model_path="", processes=tuple(specs),
                url="http://127.0.0.1:1", probe_url="http://127.0.0.1:1", expected=(), python=sys.executable)


NO_SUCH_PID = 4_000_000  # above pid_max's usual 4194304? keep it unlikely; describe_state treats it as gone


def test_supervise_fails_fast_on_a_hung_worker_on_a_fake_clock(tmp_path: Path) -> None:
    fc = FakeClock()
    hang_at = fc.t + 4.0

    def fetch(url: str, timeout: float) -> Reply:
        if "decode" in url and fc.t >= hang_at:
            return Reply(0, "", "timed out", TIMEOUT)
        return Reply(200, "ok")

    plan = _plan(_spec("prefill-0", "prefill", "http://prefill/health"),
                 _spec("decode-0", "decode", "http://decode/health"))
    sup = Supervisor(plan, RunDir.create(tmp_path / "run"), echo=lambda m: None, hang_timeout=3.0,
                     clock=fc.clock, fetch=fetch)
    for i, n in enumerate(("prefill-0", "decode-0")):
        sup.group.adopt(Child(n, n.split("-")[0], Identity(NO_SUCH_PID + i, 1, "")))
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as err:
        sup.supervise()
    assert time.monotonic() - t0 < 10, "the fake clock should make this quick"
    assert err.value.message.startswith("decode-0 is not answering after READY")
    assert hang_at + 3.0 - 1.0 <= fc.t <= hang_at + 3.0 + 1.0, fc.t - hang_at


# ------------------------------------------------------------------ stop order (fake kill seam)


@dataclass
class FakeProcs:
    """Process groups that exit `exits_after` seconds of fake time after SIGTERM (None: never)."""

    fc: FakeClock
    exits_after: dict[int, float | None]

    def __post_init__(self) -> None:
        self.calls: list[tuple[float, int, str]] = []
        self.dead_at: dict[int, float] = {}

    def killpg(self, pid: int, sig: int) -> None:
        self.calls.append((self.fc.t, pid, signal.Signals(sig).name))
        if sig == signal.SIGKILL:
            self.dead_at.setdefault(pid, self.fc.t)
        elif self.exits_after.get(pid) is not None:
            self.dead_at.setdefault(pid, self.fc.t + self.exits_after[pid])  # type: ignore[operator]

    def check(self, ident: Identity, group: bool = True) -> Verdict:
        if ident.pid == 666:
            return Verdict(False, False, "pid 666 now belongs to another process")
        gone = self.fc.t >= self.dead_at.get(ident.pid, float("inf"))
        return Verdict(not gone, gone, "exited" if gone else "")


def _group(fp: FakeProcs, fc: FakeClock, *children: tuple[str, str, int]) -> ProcessGroup:
    g = ProcessGroup(Signaller(killpg=fp.killpg, check=fp.check), fc.clock)
    for name, role, pid in children:
        g.adopt(Child(name, role, Identity(pid, 1, "")))
    return g


def test_stop_sigterms_in_reverse_order_router_first_then_sigkills_after_grace() -> None:
    fc = FakeClock()
    fp = FakeProcs(fc, {101: 1.0, 102: None, 103: 0.5})
    g = _group(fp, fc, ("prefill-0", "prefill", 101), ("decode-0", "decode", 102), ("router", "router", 103))
    rep = g.stop(grace=10.0, drain=2.0)
    terms = [(pid, s) for _, pid, s in fp.calls if s == "SIGTERM"]
    assert terms == [(103, "SIGTERM"), (102, "SIGTERM"), (101, "SIGTERM")]
    t_term_router = next(t for t, pid, s in fp.calls if pid == 103 and s == "SIGTERM")
    t_term_decode = next(t for t, pid, s in fp.calls if pid == 102 and s == "SIGTERM")
    # the router drains (exits 0.5 s after its SIGTERM) before its workers go away
    assert t_term_decode - t_term_router == pytest.approx(0.5, abs=0.05)
    kill = [(t, pid) for t, pid, s in fp.calls if s == "SIGKILL"]
    assert [p for _, p in kill] == [102], fp.calls
    assert kill[0][0] - t_term_decode == pytest.approx(10.0, abs=0.6)
    assert rep.killed == ["decode-0"] and rep.survivors == []


def test_stop_never_signals_a_group_that_is_not_ours() -> None:
    fc = FakeClock()
    fp = FakeProcs(fc, {101: 0.1})
    g = _group(fp, fc, ("prefill-0", "prefill", 101), ("decode-0", "decode", 666))
    rep = g.stop(grace=1.0)
    assert all(pid != 666 for _, pid, _ in fp.calls), fp.calls
    assert any("666" in r for r in rep.refused)


# ------------------------------------------------------------------ real processes: identity and signals


@pytest.fixture
def sleeper():
    started: list[subprocess.Popen] = []

    def start(*argv: str) -> subprocess.Popen:
        p = subprocess.Popen(list(argv) or [sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
        started.append(p)
        poll_until(lambda: identify(p.pid) and identify(p.pid).cmdlines, 5.0)  # type: ignore[union-attr]
        return p

    yield start
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_verify_accepts_our_process_and_refuses_reused_pids_foreign_cmdlines_init_and_own_group(sleeper) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    p = sleeper(*argv)
    ours = identify(p.pid, argv)
    assert ours is not None and verify(ours).ours
    reused = Identity(p.pid, ours.start_time - 7, ours.boot_id, ours.cmdlines)
    v = verify(reused)
    assert not v.ours and "another process" in v.reason
    foreign = Identity(p.pid, ours.start_time, ours.boot_id, (("/usr/sbin/sshd", "-D"),))
    v = verify(foreign)
    assert not v.ours and not v.gone and "not what we started" in v.reason
    for pid in (1, 0, -1, os.getpgrp()):
        assert not verify(Identity(pid, 0, "")).ours
    sig = Signaller()
    assert sig.send(reused, signal.SIGKILL) == "gone"
    assert sig.send(foreign, signal.SIGKILL) == "refused"
    assert sig.send(Identity(1, 1, ""), signal.SIGTERM) == "refused"
    assert p.poll() is None, "a refused signal reached the process"
    assert sig.send(ours, signal.SIGTERM) == "sent"
    assert p.wait(10) == -signal.SIGTERM
    assert sig.send(ours, signal.SIGTERM) == "gone"


def test_numactl_style_exec_keeps_the_identity(sleeper) -> None:
    """A wrapper that execs (numactl ... -- python ...) shows a suffix of the argv we recorded."""
    tail = [sys.executable, "-c", "import time; time.sleep(60)"]
    argv = ["/usr/bin/env", "--", *tail]
    p = sleeper(*argv)
    ident = identify(p.pid, argv)
    assert ident is not None
    assert poll_until(lambda: verify(ident).ours and list(open(f"/proc/{p.pid}/cmdline").read().split("\0")[:-1]) == tail, 5)


def test_pid_file_carries_the_identity_and_a_bare_pid_is_not_trusted() -> None:
    ident = Identity(4242, 123456, "boot", (("python", "-m", "x"),))
    assert parse_pid_file(pid_file_text(ident)) == ident
    assert pid_file_text(ident).splitlines()[0] == "4242"
    assert parse_pid_file("4242\n") is None
    assert parse_pid_file("4242\n{not json\n") is None


# ------------------------------------------------------------------ stop_all under write failures


@dataclass(frozen=True)
class FullDiskRunDir(RunDir):
    """A run dir whose disk fills up once `full` exists (checked per write, like a real ENOSPC)."""

    def _full(self) -> None:
        if (self.path / "full").exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path / "state.json"))

    def set_state(self, **fields: Any) -> None:
        self._full()
        super().set_state(**fields)

    def event(self, kind: str, **fields: Any) -> None:
        self._full()
        super().event(kind, **fields)

    def write_json(self, name: str, data: Any) -> None:
        self._full()
        super().write_json(name, data)


@pytest.mark.parametrize("failure", ["enospc", "stdout-closed", "both"])
def test_stop_all_stops_every_process_when_the_disk_is_full_or_stdout_is_gone(tmp_path: Path, failure: str) -> None:
    root = RunDir.create(tmp_path / "run")
    run = FullDiskRunDir(root.path)
    lost: list[str] = []

    def echo(msg: str) -> None:
        if failure != "enospc":
            lost.append(msg)
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    argv = (sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    plan = _plan(_spec("prefill-0", "prefill", "http://127.0.0.1:9/health", argv),
                 _spec("decode-0", "decode", "http://127.0.0.1:9/health", argv[:2] + ("import time; time.sleep(60)",)),
                 _spec("router", "router", "http://127.0.0.1:9/readiness", argv[:2] + ("import time; time.sleep(60)",)))
    sup = Supervisor(plan, run, echo=echo, grace=1.0)
    saved_stdout = os.dup(1)
    try:
        for spec in plan.processes:
            sup.start(spec)
        pids = {n: sup.procs[n].popen.pid for n in sup.order}  # type: ignore[union-attr]
        if failure != "stdout-closed":
            (run.path / "full").write_text("")
        sup.stop_all()  # must not raise, must not leave anything
    finally:
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
    for name, pid in pids.items():
        assert not group_alive(pid), f"{name} (pgid {pid}) was left running"


def test_a_child_that_renames_itself_is_still_stopped_but_a_stranger_with_its_record_is_not(tmp_path: Path) -> None:
    """sglang-router calls setproctitle('sglang::router') at start. Our unreaped child keeps its pid,
    so the group stops it; the bare record (what `down` would check) refuses the new title."""
    pytest.importorskip("setproctitle")
    argv = [sys.executable, "-c", "import setproctitle, time; setproctitle.setproctitle('renamed::x'); time.sleep(60)"]
    g = ProcessGroup()
    with open(tmp_path / "child.log", "w") as log:
        child = g.spawn("router", "router", argv, dict(os.environ), log)
    recorded = child.ident
    try:
        assert poll_until(lambda: Path(f"/proc/{recorded.pid}/cmdline").read_bytes().startswith(b"renamed::x"), 10)
        assert not verify(recorded).ours  # a stranger's view: the title is none of the recorded ones
        rep = g.stop(grace=2.0)
        assert rep.refused == [] and not group_alive(recorded.pid), rep
    finally:
        if group_alive(recorded.pid):
            os.killpg(recorded.pid, signal.SIGKILL)
