"""Supervisor: start a Plan, gate readiness, supervise, stop — fail fast, never leave a process behind.

Behaviour from srt-slurm's direct runner and honcho's manager: each process in its own session
(so its own process group, and a terminal Ctrl-C reaches only us), per-process .log/.command/.pid;
prefill and decode start together, the router only after every worker's /health is 200, READY only
after the router reports the expected worker counts and one real generate went through it (that
request also pays the ~38 s UCX cold start, field-notes 6). Any process exiting on its own stops
all of them in reverse start order: SIGTERM to the group, grace period, SIGKILL to the group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from v4flash_pd.errors import RuntimeFailure
from v4flash_pd.httpcheck import request
from v4flash_pd.plan import Plan, ProcessSpec
from v4flash_pd.procs import group_alive, signal_group
from v4flash_pd.render import command_line
from v4flash_pd.rundir import RunDir

Echo = Callable[[str], None]


class StopRequested(Exception):
    """SIGTERM/SIGINT reached the launcher: stop gracefully, exit 0."""


@dataclass
class Running:
    spec: ProcessSpec
    popen: subprocess.Popen
    log: TextIO
    started: float
    returncode: int | None = None


@dataclass
class Supervisor:
    plan: Plan
    run: RunDir
    echo: Echo
    grace: float = 30.0
    ready_timeout: float = 3600.0
    smoke_prompt: str = "The capital of France is"
    poll: float = 0.2
    progress_every: float = float(os.environ.get("V4FLASH_PROGRESS_INTERVAL", "10"))
    after_ready: Callable[["Supervisor"], None] | None = None  # e.g. the eval gate
    procs: dict[str, Running] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    _stop_signal: int | None = None

    # ------------------------------------------------------------ signals

    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self._stop_signal is None:
                self._stop_signal = signum
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _check_stop(self) -> None:
        if self._stop_signal is not None:
            raise StopRequested(signal.Signals(self._stop_signal).name)

    # ------------------------------------------------------------ processes

    def start(self, spec: ProcessSpec) -> None:
        env = dict(os.environ)
        env.update(spec.env)
        env["V4FLASH_PATCH_STATUS_DIR"] = str(self.run.file("patch"))
        env["V4FLASH_RUN_DIR"] = str(self.run.path)
        self.run.file(f"{spec.name}.command").write_text(command_line(spec) + "\n")
        log = open(self.run.log(spec.name), "a", buffering=1)
        log.write(f"# v4flash-pd: starting {spec.name} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        log.flush()
        try:
            popen = subprocess.Popen(list(spec.argv), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except OSError as exc:
            log.close()
            raise RuntimeFailure(f"could not start {spec.name}: {exc}",
                                 f"check the command in {self.run.file(spec.name + '.command')}") from None
        self.run.file(f"{spec.name}.pid").write_text(f"{popen.pid}\n")
        self.procs[spec.name] = Running(spec, popen, log, time.monotonic())
        self.order.append(spec.name)
        self.run.event("start", name=spec.name, pid=popen.pid, argv=list(spec.argv))
        self._record_pids()

    def _record_pids(self) -> None:
        self.run.set_state(pids={n: r.popen.pid for n, r in self.procs.items()})

    def _reap(self) -> None:
        """As PID 1 (a container without tini) orphans are ours to reap, or they stay zombies."""
        by_pid = {r.popen.pid: r for r in self.procs.values()}
        for r in self.procs.values():
            if r.returncode is None:
                rc = r.popen.poll()
                if rc is not None:
                    r.returncode = rc
        if os.getpid() != 1:
            return
        for _ in range(1000):  # bounded
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            r = by_pid.get(pid)
            if r is not None and r.returncode is None:
                r.returncode = os.waitstatus_to_exitcode(status)
                r.popen.returncode = r.returncode

    def exited(self) -> Running | None:
        self._reap()
        return next((self.procs[n] for n in self.order if self.procs[n].returncode is not None), None)

    def _fail_exited(self, r: Running, phase: str) -> None:
        rc = r.returncode
        how = f"was killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exited with code {rc}"
        self.run.event("exit", name=r.spec.name, returncode=rc, phase=phase)
        raise RuntimeFailure(
            f"{r.spec.name} {how} {phase}; stopping everything. Last lines of {self.run.log(r.spec.name)}:\n"
            + "\n".join("    | " + line for line in self.run.tail(r.spec.name, 30)),
            f"read the full log with `v4flash-pd logs {r.spec.name} --run-dir {self.run.path}`",
        )

    def stop_all(self) -> None:
        """Reverse start order: SIGTERM each group, wait up to `grace` in total, SIGKILL the rest."""
        names = list(reversed(self.order))
        if not names:
            return
        self.echo(f"stopping {', '.join(names)} (SIGTERM, grace {self.grace:g}s)")
        self.run.set_state(status="stopping")
        for name in names:
            r = self.procs[name]
            signal_group(r.popen.pid, signal.SIGTERM)
            # give the router a moment to drain before its workers go away
            if r.spec.role == "router":
                self._wait_groups([r], min(2.0, self.grace))
        deadline = time.monotonic() + self.grace
        self._wait_groups([self.procs[n] for n in names], max(0.0, deadline - time.monotonic()))
        for name in names:
            r = self.procs[name]
            if group_alive(r.popen.pid):
                self.echo(f"{name} did not stop within {self.grace:g}s: SIGKILL")
                self.run.event("sigkill", name=name)
                signal_group(r.popen.pid, signal.SIGKILL)
        self._wait_groups([self.procs[n] for n in names], 5.0)
        for name in names:
            r = self.procs[name]
            try:
                r.popen.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
            r.log.close()
            self.run.event("stopped", name=name, returncode=r.popen.returncode)

    def _wait_groups(self, procs: list[Running], timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._reap()
            if not any(group_alive(r.popen.pid) for r in procs):
                return
            time.sleep(0.05)

    # ------------------------------------------------------------ readiness

    def _wait(self, what: str, deadline: float, check: Callable[[], tuple[bool, str]]) -> None:
        """Poll `check` until it passes; fail fast on exits/signals; progress every few seconds."""
        t0 = time.monotonic()
        last = t0
        while True:
            self._check_stop()
            r = self.exited()
            if r is not None:
                self._fail_exited(r, f"while waiting for {what}")
            ok, detail = check()
            if ok:
                return
            now = time.monotonic()
            if now > deadline:
                raise RuntimeFailure(
                    f"timed out after {now - t0:.0f}s waiting for {what} ({detail})",
                    f"raise --ready-timeout (first DeepSeek-V4 start can take ~60 min), or look at the logs in {self.run.path}",
                )
            if now - last >= self.progress_every:
                self.echo(f"[{now - t0:6.0f}s] waiting for {what}: {detail}")
                last = now
            time.sleep(self.poll)

    def _health_check(self, workers: list[ProcessSpec]) -> Callable[[], tuple[bool, str]]:
        healthy: set[str] = set()

        def check() -> tuple[bool, str]:
            states = []
            for w in workers:
                if w.name not in healthy:
                    rep = request(w.health_url, timeout=5.0)
                    if rep.status == 200:
                        healthy.add(w.name)
                        self.echo(f"{w.name} is healthy ({w.health_url})")
                        self.run.event("healthy", name=w.name)
                    else:
                        states.append(f"{w.name} {'loading (HTTP %d)' % rep.status if rep.status else 'not listening yet'}")
            return len(healthy) == len(workers), ", ".join(states) or "all healthy"

        return check

    def _router_check(self, router: ProcessSpec) -> Callable[[], tuple[bool, str]]:
        base = router.health_url.rsplit("/", 1)[0]

        def check() -> tuple[bool, str]:
            rep = request(router.health_url, timeout=5.0)
            if rep.status != 200:
                return False, f"router /readiness HTTP {rep.status or 'no answer'}"
            counts = worker_counts(request(base + "/workers", timeout=5.0))
            missing = [f"{role} {counts.get(role, 0)}/{n}" for role, n in self.plan.expected if counts.get(role, 0) < n]
            if missing:
                return False, "router sees " + ", ".join(missing)
            return True, "ready"

        return check

    def smoke(self, deadline: float) -> str:
        """One real generate through the front door; retried until the deadline (cold UCX paths)."""
        payload = {"text": self.smoke_prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        url = self.plan.probe_url + "/generate"
        last = ""
        while True:
            self._check_stop()
            r = self.exited()
            if r is not None:
                self._fail_exited(r, "during the smoke request")
            rep = request(url, payload, timeout=max(5.0, min(600.0, deadline - time.monotonic())))
            if rep.status == 200:
                try:
                    text = rep.json().get("text", "")
                except ValueError:
                    text = ""
                if text:
                    return text
                last = f"HTTP 200 without generated text: {rep.body[:200]}"
            else:
                last = f"HTTP {rep.status or 'no answer'}: {(rep.body or rep.error)[:300]}"
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"the smoke generate through {url} failed: {last}",
                                     f"check the decode/prefill logs in {self.run.path} (KV transfer, bootstrap port)")
            time.sleep(1.0)

    # ------------------------------------------------------------ lifecycle

    def start_and_wait_ready(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.ready_timeout
        self.run.set_state(status="starting", launcher_pid=os.getpid(), url=self.plan.url, started=time.time())
        workers = list(self.plan.workers())
        for w in workers:
            self.start(w)
        self.echo(f"started {', '.join(w.name for w in workers)}; waiting for /health (logs in {self.run.path})")
        self._wait("workers to load", deadline, self._health_check(workers))
        router = self.plan.router()
        if router is not None:
            self.start(router)
            self._wait("the router to see all workers", deadline, self._router_check(router))
        self.echo("sending one generate request through " + self.plan.probe_url)
        text = self.smoke(deadline)
        self.run.event("smoke", text=text)
        if self.after_ready is not None:
            self.after_ready(self)
        took = time.monotonic() - t0
        self.run.set_state(status="ready", ready_seconds=round(took, 3), smoke_text=text)
        self.run.event("ready", seconds=round(took, 3))

    def supervise(self) -> None:
        """Block until a process exits (-> RuntimeFailure) or a signal arrives (-> StopRequested)."""
        while True:
            self._check_stop()
            r = self.exited()
            if r is not None:
                self._fail_exited(r, "unexpectedly")
            time.sleep(self.poll)


def worker_counts(rep: Any) -> dict[str, int]:
    """Healthy prefill/decode counts from sglang-router 0.3.2's GET /workers."""
    if rep.status != 200:
        return {}
    try:
        data = rep.json()
    except ValueError:
        return {}
    items = data.get("workers", data) if isinstance(data, dict) else data
    counts: dict[str, int] = {}
    if isinstance(items, list):
        for w in items:
            if not isinstance(w, dict):
                continue
            if w.get("is_healthy", w.get("healthy", True)) is False:
                continue
            kind = str(w.get("worker_type", w.get("type", ""))).lower()
            for role in ("prefill", "decode"):
                if role in kind:
                    counts[role] = counts.get(role, 0) + 1
    stats = data.get("stats") if isinstance(data, dict) else None
    if isinstance(stats, dict) and not counts:
        for role in ("prefill", "decode"):
            n = stats.get(f"{role}_count")
            if isinstance(n, int):
                counts[role] = n
    return counts


def print_err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
