"""Run the self-check jobs: one process per GPU in parallel, watched, restarted, never left behind.

Each process writes its record (`v4flash.selfcheck.gpu/1`) after every case, naming the case it
is in. From that the driver tells apart: a normal end (exit 0/1), a CUDA error that lost the
process's context (exit 3: the finished patches stand, a fresh process checks the rest), a
process that died (a signal or an odd exit: the patch it was in fails as `crash`), one that made
no progress for the case timeout (killed, the patch fails as `timeout`, a fresh process checks the
rest) and one that could not start checking at all (exit 2: no GPU visible, torch missing; every
patch it had fails as `harness_error`). Whatever happens, every child is killed on the way out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from v4flash_pd.selfcheck.jobs import Job

CASE_TIMEOUT_ENV = "V4FLASH_SELFCHECK_CASE_TIMEOUT"
DEFAULT_CASE_TIMEOUT = 300.0  # one case, cold compiles included; a hung kernel costs this much
PROGRESS_EVERY = 15.0
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONTEXT_LOST = 0, 1, 2, 3
FINAL = ("pass", "fail", "unchecked")

Echo = Callable[[str], None]


class Interrupted(Exception):
    """SIGTERM/SIGHUP arrived while the self-check ran (the children are killed before this propagates)."""


@dataclass
class _Gpu:
    job: Job
    log: Path
    patches: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempts: int = 0
    last: dict[str, Any] | None = None  # the newest record read
    notes: list[str] = field(default_factory=list)
    started: float = 0.0
    seconds: float = 0.0

    def remaining(self) -> tuple[str, ...]:
        return tuple(p for p in self.job.patches if p not in self.patches)


@dataclass
class _Proc:
    gpu: _Gpu
    job: Job
    popen: Any  # subprocess.Popen, or _Failed when the interpreter could not even start
    json_path: Path
    started_wall: float


def case_timeout(env: Mapping[str, str]) -> float:
    """Seconds one case may run without progress; UserError for a value that is not a positive number."""
    from v4flash_pd.errors import UserError

    raw = env.get(CASE_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_CASE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UserError(f"{CASE_TIMEOUT_ENV}={raw!r} is not a positive number of seconds",
                        f"unset it (default {DEFAULT_CASE_TIMEOUT:.0f}) or give e.g. {CASE_TIMEOUT_ENV}=600")
    return value


def run_jobs(jobs: tuple[Job, ...], workdir: Path, launcher_env: Mapping[str, str], echo: Echo,
             timeout: float | None = None) -> list[dict[str, Any]]:
    """Run every job to the end; one merged record per GPU (GPU order)."""
    workdir.mkdir(parents=True, exist_ok=True)
    # one fresh meeting place per worker for this run (a stale file store would hold another run's ranks)
    rendezvous = workdir / f"rendezvous-{os.getpid()}-{time.time_ns()}"
    if any(j.group for j in jobs):
        rendezvous.mkdir()
    limit = timeout if timeout is not None else case_timeout(launcher_env)
    gpus = [_Gpu(j, workdir / f"selfcheck-gpu{j.gpu}.log") for j in jobs]
    running: list[_Proc] = []
    t0 = time.monotonic()
    last_progress = t0
    with _signals_raise():
        try:
            for g in gpus:
                g.started = time.monotonic()
                with _signals_held():  # a child exists only once `running` holds it
                    running.append(_start(g, g.job, workdir, launcher_env, rendezvous))
            while running:
                for p in list(running):
                    rc = p.popen.poll()
                    rec = _read(p.json_path)
                    if rec is not None:
                        p.gpu.last = rec
                    if rc is None:
                        since = _since(rec, p.started_wall)
                        if time.time() - since <= limit:
                            continue
                        _kill(p.popen)
                        what = _running_name(rec)
                        _settle(p, rec, None, f"made no progress for {limit:.0f}s while running {what} (killed)")
                    else:
                        _settle(p, rec, rc, "")
                    running.remove(p)
                    with _signals_held():
                        nxt = _next(p.gpu, workdir, launcher_env, rendezvous)
                        if nxt is not None:
                            running.append(nxt)
                    if nxt is None:
                        p.gpu.seconds = round(time.monotonic() - p.gpu.started, 3)
                        echo(_done_line(p.gpu))
                now = time.monotonic()
                if running and now - last_progress >= PROGRESS_EVERY:
                    last_progress = now
                    echo(_progress_line(gpus, running, now - t0))
                time.sleep(0.1)
        finally:
            for p in running:
                _kill(p.popen)
            shutil.rmtree(rendezvous, ignore_errors=True)
    return [_merged(g) for g in gpus]


def _start(g: _Gpu, job: Job, workdir: Path, launcher_env: Mapping[str, str], rendezvous: Path) -> _Proc:
    g.attempts += 1
    json_path = workdir / f"selfcheck-gpu{job.gpu}.try{g.attempts}.json"
    env = dict(launcher_env)
    env.update(dict(job.env))
    with open(g.log, "a", encoding="utf-8") as log:
        log.write(f"# v4flash-pd: self-check GPU {job.gpu} ({job.worker}) attempt {g.attempts} at "
                  f"{time.strftime('%Y-%m-%dT%H:%M:%S')}: {' '.join(job.argv)}\n")
        log.flush()
        popen: Any
        try:
            group = ("--group", str(rendezvous / f"{job.group}.store")) if job.group else ()
            popen = subprocess.Popen([*job.argv, *group, "--json", str(json_path)], env=env, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:  # the workers' interpreter does not exist / cannot run
            popen = _Failed(f"could not be started ({job.argv[0]}: {exc.strerror or exc})")
    return _Proc(g, job, popen, json_path, time.time())


class _Failed:
    """Stands in for a Popen that could not start: exited with 127."""

    def __init__(self, why: str) -> None:
        self.why = why
        self.returncode = 127
        self.pid = -1

    def poll(self) -> int:
        return 127


def _next(g: _Gpu, workdir: Path, launcher_env: Mapping[str, str], rendezvous: Path) -> _Proc | None:
    """A fresh process for the patches not yet decided, if any (each attempt must decide at least one)."""
    rest = g.remaining()
    if not rest or g.attempts > len(g.job.patches):
        for name in rest:
            g.patches[name] = _failed_entry("harness_error", "no check process decided it "
                                            f"in {g.attempts} attempt(s); see {g.log.name}")
        return None
    g.notes.append(f"attempt {g.attempts + 1} for {', '.join(rest)}")
    return _start(g, g.job.with_patches(rest), workdir, launcher_env, rendezvous)


def _settle(p: _Proc, rec: dict[str, Any] | None, rc: int | None, timeout_why: str) -> None:
    """Take every patch this process decided; decide the one it was in when it stopped abnormally."""
    g = p.gpu
    entries = rec.get("patches") if isinstance(rec, dict) else None
    entries = entries if isinstance(entries, dict) else {}
    before = len(g.patches)
    for name in p.job.patches:
        done = entries.get(name)
        if isinstance(done, dict) and done.get("status") in FINAL:
            g.patches[name] = done
    progress = len(g.patches) > before
    if not timeout_why and isinstance(rec, dict) and rec.get("context_lost"):
        rc = EXIT_CONTEXT_LOST  # whatever the exit looked like, its record says why it stopped
    if timeout_why:
        cls, why = "timeout", timeout_why
    elif rc == EXIT_CONTEXT_LOST:
        g.notes.append("a CUDA error lost a check process's context; a fresh process checked the rest")
        return
    elif rc in (EXIT_OK, EXIT_FAILED) and isinstance(rec, dict) and rec.get("done"):
        return
    elif rc == EXIT_USAGE:
        why = _tail(g.log) or "the check process refused to start"
        for name in p.job.patches:
            g.patches.setdefault(name, _failed_entry("harness_error", f"the self-check could not run on this GPU: {why}"))
        return
    else:
        how = getattr(p.popen, "why", "") or _exit_words(rc)
        tail = _tail(g.log)
        cls, why = "crash", f"the check process {how} while running {_running_name(rec)}" + (f": {tail}" if tail else "")
    open_names = [n for n in p.job.patches if n not in g.patches and isinstance(entries.get(n), dict)]
    if not open_names:
        if progress:  # it stopped between patches: a fresh process checks the rest
            g.notes.append(f"{why}; a fresh process checks the rest")
            return
        # it stopped before deciding anything: another process would stop the same way
        open_names = [n for n in p.job.patches if n not in g.patches]
    for name in open_names:
        found = entries.get(name)
        e: dict[str, Any] = found if isinstance(found, dict) else {"cases": []}
        if e.get("phase") == "upstream":  # ours' cases were all done: only upstream's comparisons were left
            verdict = "fail" if any(c.get("status") == "fail" for c in e.get("cases") or []) else "pass"
            g.patches[name] = dict(e, status=verdict, upstream=f"upstream's comparisons did not finish: {why}")
        else:
            g.patches[name] = {**e, **_failed_entry(cls, why), "cases": list(e.get("cases") or [])}


def _failed_entry(cls: str, why: str) -> dict[str, Any]:
    return {"status": "fail", "class": cls, "error": why, "cases": []}


def _merged(g: _Gpu) -> dict[str, Any]:
    last = g.last or {}
    return {
        "gpu": g.job.gpu, "worker": g.job.worker, "role": g.job.role, "attempts": g.attempts, "seconds": g.seconds,
        "log": g.log.name, "device": last.get("device") or {}, "target": last.get("target") or {},
        "standin": bool(last.get("standin")), "interpreter": bool(last.get("interpreter")),
        "patches": {n: g.patches[n] for n in g.job.patches if n in g.patches}, "notes": g.notes,
    }


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _since(rec: dict[str, Any] | None, default: float) -> float:
    run = rec.get("running") if isinstance(rec, dict) else None
    since = run.get("since") if isinstance(run, dict) else None
    return float(since) if isinstance(since, (int, float)) else default


def _running_name(rec: dict[str, Any] | None) -> str:
    run = rec.get("running") if isinstance(rec, dict) else None
    if isinstance(run, dict) and run.get("patch"):
        return f"{run['patch']} / {run.get('case', '?')}"
    return "its start-up (no case begun)"


def _exit_words(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def _tail(log: Path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                 if ln.strip() and not ln.startswith("# v4flash-pd:")]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-600:]


def _kill(popen: Any) -> None:
    if getattr(popen, "pid", -1) <= 0 or popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        popen.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _done_line(g: _Gpu) -> str:
    parts = [f"{n} {g.patches[n]['status'].upper() if g.patches[n]['status'] == 'fail' else g.patches[n]['status']}"
             for n in g.job.patches if n in g.patches]
    extra = f", {g.attempts} processes" if g.attempts > 1 else ""
    return f"self-check GPU {g.job.gpu} ({g.job.worker}): {', '.join(parts)} [{g.seconds:.1f}s{extra}]"


def _progress_line(gpus: list[_Gpu], running: list[_Proc], elapsed: float) -> str:
    done = len(gpus) - len({p.gpu.job.gpu for p in running})
    where = "; ".join(f"GPU {p.job.gpu}: {_running_name(p.gpu.last)}" for p in running[:4])
    return f"self-check: {done}/{len(gpus)} GPUs done after {elapsed:.0f}s; {where}"


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while a child is created and handed to the list the `finally` kills.

    A handler that raises inside `subprocess.Popen` (after the fork, before it returns) loses the child's
    pid: nothing can kill it then, and a check left hanging keeps its GPU. A signal that came meanwhile is
    handled right after the block, by the handler that was in place.
    """
    pending: list[int] = []
    old: dict[int, Any] = {}
    for sig in HELD_SIGNALS:
        current = signal.getsignal(sig)
        if current is None:  # installed outside Python: cannot be put back, so leave it alone
            continue
        try:
            signal.signal(sig, lambda signum, _frame: pending.append(signum))
        except ValueError:  # not the main thread: no handler of ours runs here either
            continue
        old[sig] = current
    try:
        yield
    finally:
        for held, handler in old.items():
            signal.signal(held, handler)
    for num in dict.fromkeys(pending):
        handler = old[num]
        if callable(handler):
            handler(num, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(num)


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP become `Interrupted` here (SIGINT is KeyboardInterrupt already), so the
    children are killed by the caller's `finally` instead of being orphaned with the launcher."""
    def handler(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: nothing to install
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
