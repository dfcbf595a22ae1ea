"""Process groups: spawn, reap, identify and signal them, and never signal one that is not ours.

Every launched role leads its own session, so its pid is also its process-group id, and checking the
group (not just the leader) tells whether anything of a role still runs. A pid alone is not an
identity: once a process is gone and reaped its number can be handed to anyone, so every signal is
preceded by `verify`, which compares the live process with the `Identity` recorded when it started
(pid, start time in clock ticks since boot from /proc/PID/stat field 22, the boot id, the command
line). Numbers <= 1 and the caller's own process group are refused outright: killpg on those would
take down init or the launcher itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Callable, Iterable, Mapping

from v4flash_pd.poll import SYSTEM_CLOCK, Clock, poll_until

PROC = Path("/proc")


@dataclass(frozen=True)
class Identity:
    """What makes a process this process: (pid, start time, boot) is unique; cmdlines catch retitles."""

    pid: int
    start_time: int  # clock ticks after boot (/proc/PID/stat field 22)
    boot_id: str
    cmdlines: tuple[tuple[str, ...], ...] = ()  # argv as exec'd, plus any title seen later (setproctitle)
    # The run dir the process was started for: its descendants write their output there (inherited
    # stdout/stderr) and carry V4FLASH_RUN_DIR, which tells them from a stranger in the same group.
    marker: str = ""

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"pid": self.pid, "start_time": self.start_time, "boot_id": self.boot_id,
                                "cmdlines": [list(c) for c in self.cmdlines]}
        if self.marker:
            d["marker"] = self.marker
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Identity:
        pid = d.get("pid")
        start = d.get("start_time")
        if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(start, int):
            raise ValueError(f"not a process identity: {d!r}")
        raw = d.get("cmdlines")
        items: list[object] = raw if isinstance(raw, list) else []
        cmdlines = tuple(tuple(str(a) for a in c) for c in items if isinstance(c, list))
        marker = d.get("marker")
        return cls(pid, start, str(d.get("boot_id") or ""), cmdlines, marker if isinstance(marker, str) else "")

    def with_cmdline(self, cmdline: tuple[str, ...]) -> Identity:
        if not cmdline or cmdline in self.cmdlines:
            return self
        return replace(self, cmdlines=self.cmdlines + (cmdline,))


@dataclass(frozen=True)
class Stat:
    pid: int
    state: str  # R S D T t Z X ...
    pgrp: int
    session: int
    start_time: int


def read_stat(pid: int, proc: Path = PROC) -> Stat | None:
    """Parse /proc/PID/stat; the command name (field 2) may hold spaces and ')' so split at the last ')'."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        # rest[0] is field 3 (state); field N is rest[N - 3]
        return Stat(pid, rest[0], int(rest[2]), int(rest[3]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def read_cmdline(pid: int, proc: Path = PROC) -> tuple[str, ...]:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ()
    parts = raw.decode("utf-8", "replace").split("\0")
    while parts and not parts[-1].strip():
        parts.pop()
    return tuple(p.rstrip() if i == len(parts) - 1 else p for i, p in enumerate(parts))


def boot_id(proc: Path = PROC) -> str:
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return ""


def identify(pid: int, argv: Iterable[str] | None = None, proc: Path = PROC) -> Identity | None:
    """The identity of a live pid; `argv` (what we exec'd) is recorded instead of a racy /proc read."""
    st = read_stat(pid, proc)
    if st is None:
        return None
    cmd = tuple(argv) if argv is not None else read_cmdline(pid, proc)
    return Identity(pid, st.start_time, boot_id(proc), (cmd,) if cmd else ())


def _cmdline_matches(live: tuple[str, ...], recorded: tuple[tuple[str, ...], ...]) -> bool:
    # a wrapper that execs (numactl ... -- python ...) leaves a suffix of the argv we started
    for c in recorded:
        if live == c or (live and len(live) <= len(c) and c[len(c) - len(live):] == live):
            return True
    return not recorded


@dataclass(frozen=True)
class Verdict:
    ours: bool  # signalling this group reaches only our processes
    gone: bool  # nothing of the group is left
    reason: str = ""


def refuse_reason(pgid: int) -> str:
    if pgid <= 1:
        return f"refusing to signal process group {pgid} (pid <= 1 means init or every process)"
    if pgid == os.getpgrp():
        return f"refusing to signal process group {pgid}: it is this launcher's own group"
    if pgid == os.getpid():
        return f"refusing to signal {pgid}: it is this launcher"
    return ""


def group_members(pgid: int, proc: Path = PROC) -> list[Stat]:
    out: list[Stat] = []
    try:
        entries = list(proc.iterdir())
    except OSError:
        return out
    for e in entries:
        if e.name.isdigit():
            st = read_stat(int(e.name), proc)
            if st is not None and st.pgrp == pgid and st.state not in ("Z", "X"):
                out.append(st)
    return out


def verify(ident: Identity, proc: Path = PROC, group: bool = True) -> Verdict:
    """May the group led by `ident.pid` (or, group=False, the process itself) be signalled?
    Checked right before every signal."""
    refused = refuse_reason(ident.pid)
    if refused:
        return Verdict(False, False, refused)
    if ident.boot_id and boot_id(proc) and ident.boot_id != boot_id(proc):
        return Verdict(False, True, f"pid {ident.pid} was recorded before the last reboot")
    st = read_stat(ident.pid, proc)
    if st is not None and st.start_time != ident.start_time:
        # a pid is not reused while a group of that id has members, so our group is gone
        return Verdict(False, True, f"pid {ident.pid} now belongs to another process (started at tick "
                                    f"{st.start_time}, ours at {ident.start_time})")
    if st is not None and st.state not in ("Z", "X"):
        live = read_cmdline(ident.pid, proc)
        if live and not _cmdline_matches(live, ident.cmdlines):
            return Verdict(False, False, f"pid {ident.pid} runs {' '.join(live)[:120]!r}, not what we started")
        return Verdict(True, False)
    if not group:
        return Verdict(False, True, "exited")
    # The leader exited (or is a zombie). Its group id can outlive it in processes it started, but
    # once the group was empty the pid (and so the group id) can be reused: a stranger that calls
    # setsid() with that pid and double-forks leaves a member there. Only members shown to be ours
    # may be signalled; one stranger and the whole group is refused.
    members = group_members(ident.pid, proc)
    if not members:
        return Verdict(False, True, "exited")
    for m in members:
        why = _not_our_member(m, ident, proc)
        if why:
            cmd = " ".join(read_cmdline(m.pid, proc))[:80]
            return Verdict(False, False, f"process group {ident.pid} (leader exited) holds pid {m.pid} ({cmd!r}), "
                                         f"which this run did not start: {why}; not signalling the group")
    return Verdict(True, False)


def _not_our_member(m: Stat, ident: Identity, proc: Path) -> str:
    """'' when `m` (a member of ident's group) was started by the recorded process or its children."""
    if m.start_time < ident.start_time:
        return "it is older than the recorded leader"
    if ident.cmdlines and _cmdline_matches(read_cmdline(m.pid, proc), ident.cmdlines):
        return ""
    if ident.marker and _carries_marker(m.pid, ident.marker, proc):
        return ""
    if not ident.marker:
        return "the record has no run-dir marker to check it against (written by an older v4flash-pd)"
    return f"neither its command line, its output nor its environment points at {ident.marker}"


def _carries_marker(pid: int, run_dir: str, proc: Path) -> bool:
    """stdout/stderr into the run dir (role logs are inherited), or V4FLASH_RUN_DIR=<run dir> in its
    environment (kept even by a child that redirects its output)."""
    root = run_dir.rstrip("/") + "/"
    for fd in (1, 2):
        try:
            if os.readlink(proc / str(pid) / "fd" / str(fd)).startswith(root):
                return True
        except OSError:
            pass
    try:
        env = (proc / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"V4FLASH_RUN_DIR={run_dir}".encode() in env


KillFn = Callable[[int, int], None]


@dataclass
class Signaller:
    """The kill seam: real `os.killpg` behind `verify`; tests swap both for recorders."""

    killpg: KillFn = os.killpg
    kill: KillFn = os.kill
    check: Callable[..., Verdict] = verify
    refusals: list[str] = field(default_factory=list)

    def alive(self, ident: Identity, group: bool = True) -> bool:
        return not self.check(ident, group=group).gone

    def send(self, ident: Identity, sig: int, group: bool = True) -> str:
        """'sent', 'gone' or 'refused' (reason kept in `refusals`); group=False signals the pid only."""
        v = self.check(ident, group=group)
        if v.gone:
            return "gone"
        if not v.ours:
            self.refusals.append(v.reason)
            return "refused"
        try:
            (self.killpg if group else self.kill)(ident.pid, sig)
        except ProcessLookupError:
            return "gone"
        except PermissionError as exc:
            self.refusals.append(f"pid {ident.pid}: {exc.strerror}")
            return "refused"
        return "sent"


def pid_file_text(ident: Identity) -> str:
    """`<name>.pid`: the pid on line 1 (what every pidfile reader expects), the identity on line 2."""
    return f"{ident.pid}\n{json.dumps(ident.to_dict())}\n"


def parse_pid_file(text: str) -> Identity | None:
    lines = text.splitlines()
    if len(lines) >= 2:
        try:
            ident = Identity.from_dict(json.loads(lines[1]))
        except (ValueError, TypeError, AttributeError):
            return None
        try:
            if int(lines[0]) == ident.pid:
                return ident
        except ValueError:
            return None
    return None  # a bare pid cannot be verified: never signal it


def describe_state(pid: int, proc: Path = PROC) -> str:
    """'' for a normally running process, else why it cannot answer (stopped, zombie, gone)."""
    st = read_stat(pid, proc)
    if st is None:
        return "gone"
    return {"T": "stopped by a signal (SIGSTOP/SIGTSTP)", "t": "stopped by a debugger",
            "Z": "exited (zombie)", "X": "exited", "D": "in uninterruptible I/O wait"}.get(st.state, "")


@dataclass
class Child:
    name: str
    role: str
    ident: Identity
    popen: subprocess.Popen[bytes] | None = None
    log: IO[str] | None = None
    returncode: int | None = None


@dataclass
class StopReport:
    killed: list[str] = field(default_factory=list)  # needed SIGKILL
    survivors: list[str] = field(default_factory=list)  # still there after SIGKILL (D state...)
    refused: list[str] = field(default_factory=list)


@dataclass
class ProcessGroup:
    """The launched processes in start order; spawns, reaps, signals (verified) and stops them."""

    signaller: Signaller = field(default_factory=Signaller)
    clock: Clock = SYSTEM_CLOCK
    children: dict[str, Child] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def spawn(self, name: str, role: str, argv: list[str], env: dict[str, str], log: IO[str]) -> Child:
        popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, close_fds=True)
        ident = identify(popen.pid, argv) or Identity(popen.pid, -1, boot_id(), (tuple(argv),))
        ident = replace(ident, marker=env.get("V4FLASH_RUN_DIR", ""))  # how `down` tells its children apart
        return self.adopt(Child(name, role, ident, popen, log))

    def adopt(self, child: Child) -> Child:
        self.children[child.name] = child
        self.order.append(child.name)
        return child

    def reap(self) -> None:
        """Collect exit codes; as PID 1 (a container without tini) orphans are ours to reap too."""
        for c in self.children.values():
            if c.returncode is None and c.popen is not None:
                rc = c.popen.poll()
                if rc is not None:
                    c.returncode = rc
        if os.getpid() != 1:
            return
        by_pid = {c.ident.pid: c for c in self.children.values()}
        for _ in range(1000):  # bounded
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            reaped = by_pid.get(pid)
            if reaped is not None and reaped.returncode is None:
                reaped.returncode = os.waitstatus_to_exitcode(status)
                if reaped.popen is not None:
                    reaped.popen.returncode = reaped.returncode

    def first_exited(self) -> Child | None:
        self.reap()
        return next((self.children[n] for n in self.order if self.children[n].returncode is not None), None)

    def alive(self, names: Iterable[str]) -> list[str]:
        self.reap()
        return [n for n in names if self.signaller.alive(self.children[n].ident)]

    def signal(self, name: str, sig: int) -> str:
        return self.signaller.send(self.current_identity(name), sig)

    def current_identity(self, name: str) -> Identity:
        """The recorded identity, plus the child's current title while it is our unreaped child: its
        pid cannot have been reused, so a process that renamed itself (setproctitle) is still ours."""
        c = self.children[name]
        if c.popen is not None and c.returncode is None and c.popen.poll() is None:
            c.ident = c.ident.with_cmdline(read_cmdline(c.ident.pid))
        return c.ident

    def _wait_gone(self, names: list[str], timeout: float, hurry: Callable[[], bool] = lambda: False) -> list[str]:
        left = poll_until(lambda: not self.alive(names) or hurry() or None, timeout, 0.02, self.clock)
        return self.alive(names) if left is None or hurry() else []

    def stop(self, grace: float, drain: float = 0.0, hurry: Callable[[], bool] = lambda: False) -> StopReport:
        """SIGTERM every group (routers first, given `drain` to finish), SIGKILL what outlives `grace`.

        Only signals and waits: nothing here writes a file or the terminal, so a full disk, a
        read-only run dir or a closed stdout cannot stop the stopping. `hurry()` turning true (a
        second Ctrl-C) cuts the drain and the grace period short: SIGKILL now.
        """
        rep = StopReport()
        names = list(reversed(self.order))
        first = [n for n in names if self.children[n].role == "router"]
        for n in first:
            self._term(n, rep)
        if first and drain > 0:
            self._wait_gone(first, min(drain, grace), hurry)
        for n in names:
            if n not in first:
                self._term(n, rep)
        left = self._wait_gone(names, grace, hurry)
        for n in left:
            if self._send(n, signal.SIGKILL, rep) == "sent":
                rep.killed.append(n)
        rep.survivors = self._wait_gone(left, 5.0) if left else []
        for n in names:
            c = self.children[n]
            if c.popen is not None and c.returncode is None:
                try:
                    c.returncode = c.popen.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            if c.log is not None:
                try:
                    c.log.close()
                except OSError:
                    pass
        return rep

    def _term(self, name: str, rep: StopReport) -> None:
        # a stopped (SIGSTOP) group only sees its SIGTERM once continued: let it stop gracefully
        if self._send(name, signal.SIGTERM, rep) == "sent":
            self.signal(name, signal.SIGCONT)

    def _send(self, name: str, sig: int, rep: StopReport) -> str:
        res = self.signal(name, sig)
        if res == "refused" and self.signaller.refusals:
            rep.refused.append(f"{name}: {self.signaller.refusals[-1]}")
        return res
