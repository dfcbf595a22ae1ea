"""Supervisor: start a Plan, gate readiness, supervise, stop — fail fast, never leave a process behind.

`Supervisor.run()` owns a run from its first line to its last: it starts the plan, waits for READY,
supervises, and on a stop request, a failure or anything else stops every process and records why.
Behaviour from srt-slurm's direct runner and honcho's manager, in three parts with one job each:
`procgroup.ProcessGroup` spawns, reaps and signals (each process in its own session, so a terminal
Ctrl-C reaches only us), `readiness` says what READY means (prefill and decode /health 200, then the
router's worker counts, then one real generate through it, which also pays the ~38 s UCX cold start),
and `watchdog` notices a process that stops answering. This module wires them to the run dir and the
terminal. Any process exiting or hanging stops all of them in reverse start order: SIGTERM to the
group, grace period, SIGKILL to the group. Stopping signals first and writes afterwards, and every
write on the way out is best effort: a full disk, a read-only run dir or a closed stdout must not
leave a process behind.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from v4flash_pd.diskwatch import DiskWatch
from v4flash_pd.errors import RuntimeFailure
from v4flash_pd.httpclient import Probes, Reply, request
from v4flash_pd.plan import Plan, ProcessSpec
from v4flash_pd.poll import SYSTEM_CLOCK, Clock, poll_until
from v4flash_pd.procgroup import (
    Child,
    Identity,
    ProcessGroup,
    Signaller,
    describe_state,
    identify,
    pid_file_text,
)
from v4flash_pd.readiness import (
    HealthGate,
    is_miss_when_ready,
    is_miss_while_loading,
    router_check,
    smoke_text,
    worker_counts,
)
from v4flash_pd.render import command_line, plan_text
from v4flash_pd.routerauth import auth_headers
from v4flash_pd.rundir import RunDir
from v4flash_pd.watchdog import Hang, Watchdog

Echo = Callable[[str], None]
Fetch = Callable[[str, float], Reply]
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

__all__ = ["Supervisor", "StopRequested", "worker_counts", "STOP_SIGNALS", "ready_line"]


class StopRequested(Exception):
    """SIGTERM/SIGINT/SIGHUP reached the launcher, or its stdout went away: stop gracefully."""

    def __init__(self, why: str, exit_code: int = 0) -> None:
        super().__init__(why)
        self.exit_code = exit_code


def _fetch(url: str, timeout: float) -> Reply:
    return request(url, timeout=timeout)


def _liveness_url(spec: ProcessSpec) -> str:
    # the router's /readiness drops to 503 when a worker is unhealthy; /liveness is the router itself
    return spec.health_url.rsplit("/", 1)[0] + "/liveness" if spec.role == "router" else spec.health_url


def _wall_clock() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def ready_line(plan: Plan, took: float) -> str:
    """The one line scripts wait for: `READY <url>` (a cluster's box: `READY box K ...`, no front door)."""
    tag = " [rehearsal]" if plan.rehearse else ""
    if plan.router() is None and plan.mode == "pd":
        workers = ", ".join(f"{p.name} {p.health_url.rsplit('/', 1)[0]}" for p in plan.workers())
        return f"READY {plan.scope} (took {took:.1f}s; healthy: {workers}){tag}"
    url = plan.url if plan.scope else plan.probe_url
    auth = " -H 'Authorization: Bearer <key>'" if plan.router_auth[0] else ""
    return (f"READY {url} (took {took:.1f}s; try: curl{auth} -H 'Content-Type: application/json' "
            f"{url}/generate -d '{{\"text\":\"Hi\"}}'){tag}")


@dataclass
class Reporter:
    """What a run tells its terminal and its run dir, best effort: a full disk, a read-only run dir or a
    closed stdout never stops the run (nor its stop); a lost stdout is remembered (`output_lost`) and
    ends the run at the supervisor's next check, like SIGHUP."""

    rundir: RunDir
    echo: Echo
    stamp: Callable[[], str] = _wall_clock  # the time each launcher line starts with
    write_errors: list[str] = field(default_factory=list)
    output_lost: str = ""

    def say(self, msg: str, stamped: bool = True) -> None:
        """A launcher line, with the time it happened (`stamped`; not the plan table, not READY).
        It survives a closed stdout or a hung-up terminal: the first failure is remembered, later
        output goes to /dev/null."""
        if self.output_lost:
            return
        try:
            self.echo(f"[{self.stamp()}] {msg}" if stamped else msg)
        except OSError as exc:
            self.output_lost = exc.strerror or str(exc)
            try:
                fd = os.open(os.devnull, os.O_WRONLY)
                os.dup2(fd, sys.stdout.fileno())
                os.close(fd)
            except (OSError, ValueError):
                pass

    def warn_write(self, exc: OSError) -> None:
        msg = f"{exc.strerror or exc} ({getattr(exc, 'filename', '') or self.rundir.path})"
        if msg not in self.write_errors:
            self.write_errors.append(msg)
            try:
                print(f"warning: cannot write the run dir: {msg}; carrying on", file=sys.stderr, flush=True)
            except OSError:
                pass

    def note(self, kind: str, **fields: Any) -> None:
        """An event in events.jsonl."""
        try:
            self.rundir.event(kind, **fields)
        except OSError as exc:
            self.warn_write(exc)

    def set_state(self, **fields: Any) -> None:
        try:
            self.rundir.set_state(**fields)
        except OSError as exc:
            self.warn_write(exc)


@dataclass
class Supervisor:
    """One run of a Plan: processes, readiness, supervision, the stop. What it tells the terminal and
    the run dir goes through its `Reporter`; the hang probes through `_HangWatch`."""

    plan: Plan
    rundir: RunDir
    echo: Echo
    grace: float = 30.0
    ready_timeout: float = 3600.0
    smoke_prompt: str = "The capital of France is"
    poll: float = 0.05
    progress_every: float = float(os.environ.get("V4FLASH_PROGRESS_INTERVAL", "10"))
    after_ready: Callable[[Supervisor], None] | None = None  # e.g. the eval gate
    hang_timeout: float = 60.0
    clock: Clock = SYSTEM_CLOCK
    fetch: Fetch = _fetch
    signaller: Signaller = field(default_factory=Signaller)
    stamp: Callable[[], str] = _wall_clock  # the time each launcher line starts with
    group: ProcessGroup = field(init=False)
    report: Reporter = field(init=False)
    _stop_signal: int | None = None
    _stop_count: int = 0
    _starting_watch: _HangWatch | None = None

    def __post_init__(self) -> None:
        self.group = ProcessGroup(self.signaller, self.clock)
        self.report = Reporter(self.rundir, self.echo, self.stamp)

    # ------------------------------------------------------------ terminal and run dir, best effort (Reporter)

    def say(self, msg: str, stamped: bool = True) -> None:
        self.report.say(msg, stamped)

    def note(self, kind: str, **fields: Any) -> None:
        self.report.note(kind, **fields)

    def set_state(self, **fields: Any) -> None:
        self.report.set_state(**fields)

    # ------------------------------------------------------------ signals

    def install_signal_handlers(self) -> None:
        """SIGHUP (terminal closed, SSH dropped) stops like SIGTERM: our children run in their own
        sessions, so nobody else tells them."""

        def handler(signum: int, _frame: Any) -> None:
            # Only a person's second Ctrl-C cuts the grace short (see stop_all): schedulers repeat
            # SIGTERM (Slurm's scancel per step, kubelet, docker), which must not turn into SIGKILL.
            if signum == signal.SIGINT or self._stop_signal is None:
                self._stop_count += 1
            if self._stop_signal is None:
                self._stop_signal = signum

        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)

    @staticmethod
    def ignore_stop_signals() -> None:
        """Once everything is stopped, a late SIGTERM (a scheduler repeating itself) must not kill the
        exiting launcher with -15 and turn a clean stop into a failed job."""
        for sig in STOP_SIGNALS:
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (ValueError, OSError):  # not the main thread: nothing to protect
                pass

    def _check_stop(self) -> None:
        if self._stop_signal is not None:
            raise StopRequested(signal.Signals(self._stop_signal).name)
        if self.report.output_lost:
            raise StopRequested(f"stdout closed ({self.report.output_lost})", exit_code=1)

    # ------------------------------------------------------------ processes

    @property
    def procs(self) -> dict[str, Child]:
        return self.group.children

    @property
    def order(self) -> list[str]:
        return self.group.order

    def start(self, spec: ProcessSpec) -> None:
        env = dict(os.environ)
        env.update(spec.env)
        env["V4FLASH_PATCH_STATUS_DIR"] = str(self.rundir.file("patch"))
        env["V4FLASH_RUN_DIR"] = str(self.rundir.path)
        try:
            self.rundir.file(f"{spec.name}.command").write_text(command_line(spec) + "\n")
            log = open(self.rundir.log(spec.name), "a", buffering=1)
            log.write(f"# v4flash-pd: starting {spec.name} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
            log.flush()
        except OSError as exc:
            raise RuntimeFailure(f"cannot write {spec.name}'s files in the run dir: {exc.strerror or exc}",
                                 f"free space in {self.rundir.path} or pass a writable --run-dir") from None
        try:
            child = self.group.spawn(spec.name, spec.role, list(spec.argv), env, log)
        except OSError as exc:
            log.close()
            raise RuntimeFailure(f"could not start {spec.name}: {exc}",
                                 f"check the command in {self.rundir.file(spec.name + '.command')}") from None
        self.note("start", name=spec.name, pid=child.ident.pid, argv=list(spec.argv))
        try:  # without these `down` cannot find the process: refuse to run blind
            self._record(child.ident, spec.name)
        except OSError as exc:
            raise RuntimeFailure(f"cannot record {spec.name}'s pid in the run dir: {exc.strerror or exc}",
                                 f"free space in {self.rundir.path} or pass a writable --run-dir") from None

    def _record(self, ident: Identity, name: str) -> None:
        self.rundir.file(f"{name}.pid").write_text(pid_file_text(ident))
        self.rundir.set_state(pids={n: c.ident.pid for n, c in self.procs.items()},
                           procs={n: c.ident.to_dict() for n, c in self.procs.items()})

    def _refresh_identities(self) -> None:
        """Add each process's current title (the router renames itself) so `down` still recognises it."""
        for name, c in self.procs.items():
            before = c.ident
            if c.returncode is None and self.group.current_identity(name) != before:
                try:
                    self._record(c.ident, name)
                except OSError as exc:
                    self.report.warn_write(exc)

    def exited(self) -> Child | None:
        return self.group.first_exited()

    def _fail_exited(self, c: Child, phase: str) -> None:
        rc = c.returncode
        how = f"was killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exited with code {rc}"
        self.note("exit", name=c.name, returncode=rc, phase=phase)
        raise RuntimeFailure(
            f"{c.name} {how} {phase}; stopping everything. Last lines of {self.rundir.log(c.name)}:\n"
            + "\n".join("    | " + line for line in self.rundir.tail(c.name, 30)),
            f"read the full log with `v4flash-pd logs {c.name} --run-dir {self.rundir.path}`",
        )

    def state_of(self, name: str) -> str:
        """How a process of this plan looks in /proc when it is not answering (stopped, zombie, ...);
        "" when it runs normally, is gone, or runs on another box."""
        state = describe_state(self.procs[name].ident.pid) if name in self.procs else ""
        return "" if state == "gone" else state

    def _fail_hung(self, h: Hang, phase: str) -> None:
        local = h.name in self.procs
        state = describe_state(self.procs[h.name].ident.pid) if local else ""
        self.note("hung", name=h.name, silent_for=round(h.silent_for, 3), misses=h.misses, phase=phase)
        tail = "\n".join("    | " + line for line in self.rundir.tail(h.name, 30)) if local else ""
        where = (f"Last lines of {self.rundir.log(h.name)}:\n{tail}" if local
                 else "It runs on another box: read its log there (`v4flash-pd logs` in that box's run dir).")
        logs = f"v4flash-pd logs {h.name}" + (f" --run-dir {self.rundir.path}" if local else "")
        raise RuntimeFailure(
            f"{h.name} is not answering {phase}: no healthy reply for {h.silent_for:.1f}s ({h.misses} probes "
            f"missed, last: {h.problem or 'no reply'}{'; process ' + state if state else ''}); stopping everything. "
            + where,
            f"read `{logs}`; a deadlock or a GPU stuck in a kernel "
            "looks like this (py-spy dump --pid PID shows where); raise hang_timeout if the process is only slow",
        )

    def stop_all(self) -> None:
        """Signals first (reverse start order, SIGTERM, grace, SIGKILL), then messages and records."""
        names = list(reversed(self.order))
        if not names:
            return
        # the router gets a head start to finish short in-flight requests (it takes ~1 s to exit
        # on SIGTERM by itself); waiting for it to exit before stopping the workers doubles the stop time
        already = self._stop_count
        rep = self.group.stop(self.grace, drain=0.5, hurry=lambda: self._stop_count > max(already, 1))
        self.say(f"stopped {', '.join(names)} (SIGTERM, grace {self.grace:g}s)"
                 + (f"; SIGKILL: {', '.join(rep.killed)}" if rep.killed else ""))
        for r in rep.refused:
            self.say(f"not signalled: {r}")
        for n in rep.survivors:
            self.say(f"WARNING {n} (process group {self.procs[n].ident.pid}) is still there after SIGKILL")
        for n in rep.killed:
            self.note("sigkill", name=n)
        for n in names:
            self.note("stopped", name=n, returncode=self.procs[n].returncode)

    # ------------------------------------------------------------ waiting

    def _interruptible(self, fn: Callable[[], Any], phase: str) -> Any:
        """Run a blocking call (the smoke generate can take minutes) while still reacting to
        signals, exits and hangs."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        t = threading.Thread(target=run, name="blocking-call", daemon=True)
        t.start()
        while t.is_alive():
            self._guard(phase)
            t.join(self.poll)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _guard(self, phase: str) -> None:
        """Every wait's first step: a stop request, an exited process or (once the workers are
        healthy) a frozen one ends the wait."""
        self._check_stop()
        c = self.exited()
        if c is not None:
            self._fail_exited(c, phase)
        self._refresh_identities()
        if self._starting_watch is not None:
            self._starting_watch.tick(phase)

    def _timed_out(self, what: str, waited: float, detail: str) -> RuntimeFailure:
        return RuntimeFailure(
            f"timed out after {waited:.0f}s waiting for {what} ({detail})",
            "raise --ready-timeout (first DeepSeek-V4 start can take ~60 min), or look at the logs in "
            f"{self.rundir.path}",
        )

    def _health_gate(self, workers: list[tuple[str, str]], deadline: float, what: str = "workers to load") -> None:
        """Until every (name, /health url) answered 200; one that went silent for hang_timeout fails.

        Workers of other boxes (a cluster router's upstream) have no process here: only their
        answers count, and refusing connections is normal while they load."""
        gate = HealthGate(tuple(name for name, _ in workers))
        urls = dict(workers)
        # a loading worker is polled fast (READY as soon as it answers); one answer is at most 5 s away
        watch = _HangWatch(self, workers, is_miss_while_loading, every=0.1, max_timeout=5.0)
        t0 = self.clock.now()
        last = [t0]

        def tick() -> bool:
            self._guard(f"while waiting for {what}")
            for name, rep, state in watch.tick("while loading"):
                if gate.observe(name, rep, state, timeout=min(watch.dog.probe_timeout, 5.0)):
                    watch.drop(name)  # loaded: from here on the start's and the supervisor's watches take over
                    self.say(f"{name} is healthy ({urls[name]})")
                    self.note("healthy", name=name)
            if gate.done():
                return True
            now = self.clock.now()
            if now - last[0] >= self.progress_every:
                self.say(f"[{now - t0:6.0f}s] waiting for {what}: {gate.detail()}")
                last[0] = now
            return False

        if not poll_until(tick, deadline - t0, self.poll, self.clock):
            raise self._timed_out(what, self.clock.now() - t0, gate.detail())

    def _wait(self, what: str, deadline: float, check: Callable[[], tuple[bool, str]]) -> None:
        t0 = self.clock.now()
        last = [t0]
        detail = ["no check yet"]

        def tick() -> bool:
            self._guard(f"while waiting for {what}")
            ok: bool
            ok, detail[0] = self._interruptible(check, f"while waiting for {what}")
            now = self.clock.now()
            if not ok and now - last[0] >= self.progress_every:
                self.say(f"[{now - t0:6.0f}s] waiting for {what}: {detail[0]}")
                last[0] = now
            return ok

        if not poll_until(tick, deadline - t0, self.poll, self.clock):
            raise self._timed_out(what, self.clock.now() - t0, detail[0])

    def _router_check(self, router: ProcessSpec) -> Callable[[], tuple[bool, str]]:
        headers = auth_headers(self.plan.router_auth)  # the router's /workers needs the API key too
        fetch = self.fetch if not headers else (lambda url, timeout: request(url, timeout=timeout, headers=headers))
        return lambda: router_check(fetch, router.health_url, self.plan.expected)

    def smoke(self, deadline: float) -> str:
        """One real generate through the front door; retried until the deadline (cold UCX paths)."""
        payload = {"text": self.smoke_prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        url = self.plan.probe_url + "/generate"
        why = ["no attempt made"]

        def attempt() -> str:
            self._guard("during the smoke request")
            timeout = max(5.0, min(600.0, deadline - self.clock.now()))
            # a router planned with an API key answers 401 without it (routerauth: key from file/env, never argv)
            headers = auth_headers(self.plan.router_auth)
            rep = self._interruptible(functools.partial(request, url, payload, timeout=timeout, headers=headers),
                                      "during the smoke request")
            text, why[0] = smoke_text(rep)
            return text

        text = poll_until(attempt, deadline - self.clock.now(), 0.25, self.clock)
        if not text:
            raise RuntimeFailure(f"the smoke generate through {url} failed: {why[0]}",
                                 f"check the decode/prefill logs in {self.rundir.path} (KV transfer, bootstrap port)")
        return text

    # ------------------------------------------------------------ lifecycle

    def start_and_wait_ready(self) -> None:
        """Claim the run dir, then (a cluster's router) wait for the other boxes' workers, start and gate
        this box's workers, start and gate the router, send the smoke request, run the after-ready gate."""
        self._check_stop()  # a stop (or a closed stdout) before anything started: start nothing
        t0 = self.clock.now()
        deadline = t0 + self.ready_timeout
        self._claim_run_dir()
        if self.plan.upstream:  # a cluster's router: the workers run on other boxes
            names = ", ".join(n for n, _ in self.plan.upstream)
            self.say(f"waiting for /health of the workers on the other boxes: {names}")
            self._health_gate(list(self.plan.upstream), deadline, "the cluster's workers to load")
        workers = self._start_workers(deadline)
        # from here to READY (router start, smoke, eval gate) a worker that freezes fails the start;
        # only silence counts, not 503s: the first request's cold KV path can keep SGLang busy
        self._starting_watch = _HangWatch(self, [(w.name, w.health_url) for w in workers] + list(self.plan.upstream),
                                          is_miss_while_loading)
        text = self._start_router_and_smoke(deadline)
        if self.after_ready is not None:
            self._interruptible(lambda: self.after_ready(self), "during the after-ready gate")  # type: ignore[misc]
        self._starting_watch = None
        took = self.clock.now() - t0
        self._refresh_identities()
        self.set_state(status="ready", ready_seconds=round(took, 3), smoke_text=text)
        self.note("ready", seconds=round(took, 3))

    def _claim_run_dir(self) -> None:
        """Record this launcher (state "starting", launcher.pid) or refuse to start anything."""
        me = identify(os.getpid())
        try:
            self.rundir.set_state(status="starting", launcher_pid=os.getpid(), url=self.plan.url, started=time.time(),
                                  launcher=me.to_dict() if me else None)
            if me is not None:
                self.rundir.file("launcher.pid").write_text(pid_file_text(me))
        except OSError as exc:
            raise RuntimeFailure(f"cannot write the run dir {self.rundir.path}: {exc.strerror or exc}",
                                 "free space there or pass a writable --run-dir") from None

    def _start_workers(self, deadline: float) -> list[ProcessSpec]:
        """Start this box's workers and wait until each answers /health 200."""
        workers = list(self.plan.workers())
        for w in workers:
            self.start(w)
        if workers:
            self.say(f"started {', '.join(w.name for w in workers)}; waiting for /health (logs in {self.rundir.path})")
            self._health_gate([(w.name, w.health_url) for w in workers], deadline)
        return workers

    def _start_router_and_smoke(self, deadline: float) -> str:
        """Start the router (if this part has one) until it sees every worker, then one generate through
        the front door; the smoke's text ("" when this part has no front door)."""
        router = self.plan.router()
        if router is not None:
            self.start(router)
            self._wait("the router to see all workers", deadline, self._router_check(router))
            self.note("router_ready")
        if router is None and self.plan.mode == "pd":  # one box of a cluster has no front door of its own
            return ""
        self.say("sending one generate request through " + self.plan.probe_url)
        text = self.smoke(deadline)
        self.note("smoke", text=text)
        return text

    def supervise(self) -> None:
        """Block until a process exits or hangs (-> RuntimeFailure) or a stop arrives (-> StopRequested)."""
        headers = auth_headers(self.plan.router_auth)  # should the router guard its probes one day
        router_fetch: Fetch = lambda url, timeout: request(url, timeout=timeout, headers=headers)  # noqa: E731
        # the local processes, and (a cluster's router) the workers on other boxes it routes to: one
        # of those dying or hanging fails this part as a local worker fails a one-box run
        targets = [(n, _liveness_url(self.plan.get(n))) for n in self.order] + list(self.plan.upstream)
        watch = _HangWatch(self, targets, is_miss_when_ready,
                           lambda name: router_fetch if headers and name in self.procs
                           and self.procs[name].role == "router" else None)
        disk = DiskWatch(self.rundir.path)  # a full run dir loses every log line: say so, keep serving

        def tick() -> bool:
            self._guard("unexpectedly")
            watch.tick("after READY")
            change = disk.check(self.clock.now())
            if change:
                self.say(change)
                self.set_state(run_dir_full=disk.full)  # best effort: on a full disk `status` looks itself
            return False

        poll_until(tick, math.inf, self.poll, self.clock)

    def run(self) -> None:
        """The whole run: start, READY, supervise until a stop request (-> exit 0, or the stop's own exit
        code for a lost stdout) or a failure (raised on); whatever ends it, every process is stopped
        first and the run dir records how it ended."""
        self.install_signal_handlers()  # SIGTERM, SIGINT and SIGHUP
        self.say(plan_text(self.plan, show_commands=False), stamped=False)
        self.say(f"run dir  {self.rundir.path}", stamped=False)
        t0 = self.clock.now()
        try:
            self.start_and_wait_ready()
            self.say(ready_line(self.plan, self.clock.now() - t0), stamped=False)
            self.supervise()
        except StopRequested as stop:
            self.stop_all()  # signals first; every write below is best effort
            self.ignore_stop_signals()
            self.set_state(status="stopped", stopped=time.time(), reason=str(stop))
            self.say(f"received {stop}; stopped cleanly")
            if stop.exit_code:
                try:
                    print(f"error: {stop}; stopped every process of {self.rundir.path}", file=sys.stderr, flush=True)
                except OSError:
                    pass
                raise SystemExit(stop.exit_code) from None
        except RuntimeFailure as exc:
            self.stop_all()
            self.set_state(status="failed", stopped=time.time(), reason=exc.message.splitlines()[0])
            raise
        except BaseException as exc:
            self.stop_all()
            self.set_state(status="failed", stopped=time.time(), reason=repr(exc))
            raise


class _HangWatch:
    """Probes `targets` in the background on every `tick` and fails the supervisor on a hang: the one
    watch of the health gate (while loading), the start (until READY) and supervision (after it)."""

    def __init__(self, sup: Supervisor, targets: list[tuple[str, str]], is_miss: Callable[[Reply, str], bool],
                 fetch_for: Callable[[str], Fetch | None] = lambda _name: None, *, every: float | None = None,
                 max_timeout: float = math.inf) -> None:
        self.sup = sup
        self.is_miss = is_miss
        self.fetch_for = fetch_for
        self.max_timeout = max_timeout
        self.dog = Watchdog(sup.hang_timeout, every=every)
        self.probes = Probes(sup.fetch)
        now = sup.clock.now()
        for name, url in targets:
            self.dog.add(name, url, now)

    def drop(self, name: str) -> None:
        self.dog.remove(name)

    def tick(self, phase: str) -> list[tuple[str, Reply, str]]:
        """Start the probes that are due and take in the answers; (name, reply, process state) of each."""
        clock = self.sup.clock
        now = clock.now()
        for name, url, timeout in self.dog.due(now):
            self.probes.start(name, url, min(timeout, self.max_timeout), now, self.fetch_for(name))
        seen = []
        for name, started, rep in self.probes.results():
            if name not in self.dog.watches:  # dropped while its probe was out
                continue
            state = self.sup.state_of(name)
            self.dog.observe(name, not self.is_miss(rep, state), started, clock.now(),
                             problem=state or rep.error or f"HTTP {rep.status}")
            seen.append((name, rep, state))
        hung = self.dog.hung(clock.now())
        if hung:
            self.sup._fail_hung(hung[0], phase)
        return seen
