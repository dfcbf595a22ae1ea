"""What `up` (and `selfcheck`, `doctor --gpu`) do with the self-check.

`up` runs it after its preflight and before any worker starts. A patch that fails on any GPU of
the plan is switched off for the run *through the plan*: `up`'s own options are resolved again
with `--<patch> off`, so the plan, `plan.json` and every worker's `V4FLASH_<PATCH>=0` say so, and
SGLang runs upstream's function for it. A switch at `auto` (on by default only where verified:
the IPC all-reduce) is off in the plan and checked too; once it passed on every GPU, `up`
resolves again with `--<patch> on`. `--strict-selfcheck` refuses to start instead of switching a
failing patch off, and refuses a switched-on patch that has no self-check; `--no-selfcheck` skips
the check (the switched-on patches run unverified, the `auto` ones stay off).

`up --detach` checks in the foreground (the operator sees the verdict, and a strict refusal,
before the launcher detaches); the detached launcher gets the plan already decided.

A stop request during the check is answered as `up`'s supervisor answers it later: SIGTERM,
SIGHUP or SIGINT (exit 0) and a closed stdout (exit 1) kill the check's processes, nothing starts,
and the run dir says `stopped` and why.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn

from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.plan import Plan
from v4flash_pd.rundir import RunDir
from v4flash_pd.selfcheck import result
from v4flash_pd.selfcheck.driver import Interrupted, case_timeout, run_jobs
from v4flash_pd.selfcheck.jobs import jobs_for

Echo = Callable[[str], None]
SKIPPED = "--no-selfcheck"  # state.json's selfcheck_skipped: why this run has no selfcheck.json
DEVICE_ENV = "V4FLASH_SELFCHECK_DEVICE"  # "cpu": the real kernels' small shapes on Triton's interpreter (CI)


def patches_on(plan: Plan) -> tuple[str, ...]:
    return tuple(name for name, on in plan.patches if on)


def patches_to_check(plan: Plan) -> tuple[str, ...]:
    """The switched-on patches and the `auto` ones waiting for this check, in registry order."""
    return tuple(name for name, on in plan.patches if on or name in plan.pending_patches)


@dataclass(frozen=True)
class Decision:
    """What `up` changes in its plan after the check: switched off (failed), switched on (`auto`, passed)."""

    off: tuple[str, ...] = ()
    on: tuple[str, ...] = ()


def plan_gpus(plan: Plan) -> list[int]:
    return sorted({g for w in plan.workers() for g in w.gpus})


def run_check(plan: Plan, out_dir: Path, echo: Echo, env: Mapping[str, str] | None = None,
              patches: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Check `patches` (default: every patch the plan switches on) on every GPU of its workers, one
    process per GPU; writes `out_dir/selfcheck.json` (and per-GPU logs under `out_dir/selfcheck/`)."""
    launcher_env = dict(os.environ if env is None else env)
    names = patches_to_check(plan) if patches is None else patches
    device = check_seams(launcher_env)
    standin = plan.rehearse and device != "cpu"
    jobs = jobs_for(plan, names, launcher_env, standin=standin, device=device)
    how = ("rehearsal: stand-in" if standin else "Triton interpreter, small shapes" if device == "cpu"
           else "one process per GPU")
    echo(f"kernel self-check: {', '.join(names)} on GPU(s) {result.gpu_ranges(plan_gpus(plan))} ({how}) ...")
    t0 = time.time()
    gpus = run_jobs(jobs, out_dir / "selfcheck", launcher_env, echo)
    summary = result.summarize(gpus, names, time.time() - t0, t0)
    summary["device"] = device
    result.write(out_dir, summary)
    return summary


def check_seams(env: Mapping[str, str]) -> str:
    """The device to check on; a malformed test seam is refused before any process starts."""
    from v4flash_kernels.selfcheck import inject

    device = env.get(DEVICE_ENV, "").strip().lower() or "cuda"
    if device not in ("cuda", "cpu"):
        raise UserError(f"{DEVICE_ENV}={env.get(DEVICE_ENV)!r} is not cuda or cpu",
                        f"unset it (the GPUs), or {DEVICE_ENV}=cpu for the interpreter (tests)")
    try:
        inject.parse(env.get(inject.ENV, ""))
    except ValueError as exc:
        raise UserError(str(exc), f"unset {inject.ENV} (a test seam)") from None
    case_timeout(env)
    return device


class OutputClosed(Exception):
    """`up`'s stdout went away during the check (the reader of `up | head` quit)."""


def _closing(echo: Echo) -> Echo:
    """`echo` that turns a closed stdout into OutputClosed: the check's children are killed on the way
    out, and `up` stops the way its supervisor stops for a lost stdout."""
    def say(msg: str) -> None:
        try:
            echo(msg)
        except OSError as exc:
            raise OutputClosed(exc.strerror or str(exc)) from None
    return say


def _stop(run: RunDir, why: str, exit_code: int, echo: Echo) -> NoReturn:
    """A stop request during the check, as the supervisor answers one: nothing was started, the run
    dir says stopped, exit 0 for a signal and 1 for a lost stdout (which then goes to /dev/null, so
    the interpreter's last flush cannot fail too)."""
    run.set_state(status="stopped", stopped=time.time(), reason=f"{why} during the kernel self-check")
    if exit_code:
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, sys.stdout.fileno())
            os.close(fd)
        except (OSError, ValueError):
            pass
        try:
            print(f"error: {why} during the kernel self-check; nothing was started ({run.path})", file=sys.stderr,
                  flush=True)
        except OSError:
            pass
    else:
        try:
            echo(f"received {why} during the kernel self-check; stopped, nothing was started")
        except OSError:
            pass
    raise SystemExit(exit_code)


def gate(plan: Plan, no_selfcheck: bool, strict: bool, run: RunDir, echo: Echo) -> Decision:
    """`up`'s step between preflight and the first worker: the patches to switch off and the `auto`
    ones to switch on for this run (`up` resolves its options again with them); raises RuntimeFailure
    under --strict-selfcheck. SIGTERM/SIGHUP/SIGINT or a closed stdout during the check stop `up`
    (SystemExit), as they would stop its supervisor."""
    names = patches_on(plan)
    # a run dir's verdict is always its own run's: a reused run dir's previous one goes first
    result.clear(run.path)
    skipped = no_selfcheck and bool(patches_to_check(plan)) and bool(plan.workers())
    run.set_state(selfcheck_skipped=SKIPPED if skipped else None)
    if no_selfcheck:
        if names and plan.workers():
            echo(f"kernel self-check: skipped ({SKIPPED}); {', '.join(names)} run unverified on these GPUs")
        if plan.pending_patches and plan.workers():
            echo(f"kernel self-check: skipped ({SKIPPED}); {', '.join(plan.pending_patches)} stay(s) off "
                 "(on by default only once verified on this box)")
        return Decision()
    if not patches_to_check(plan) or not plan.workers():
        return Decision()
    check_seams(os.environ)
    run.set_state(status="selfcheck", launcher_pid=os.getpid(), started=time.time())
    try:
        return _checked(plan, strict, run, _closing(echo))
    except OutputClosed as exc:
        _stop(run, f"stdout closed ({exc})", 1, echo)
    except Interrupted as exc:
        _stop(run, str(exc), 0, echo)
    except KeyboardInterrupt:
        _stop(run, "SIGINT", 0, echo)
    except RuntimeFailure:
        raise  # --strict-selfcheck: the run dir says failed already
    except BaseException as exc:
        run.set_state(status="failed", stopped=time.time(), reason=f"kernel self-check: {exc!r}")
        raise


@dataclass(frozen=True)
class Verdict:
    """The check's outcome for `up`: what changes, and whether --strict-selfcheck refuses."""

    decision: Decision
    failed: tuple[str, ...]  # switched-on patches that failed
    unchecked: tuple[str, ...]  # switched-on patches with no self-check
    kept_off: tuple[str, ...]  # `auto` patches that did not pass: they stay off
    refuse: bool


def decide(summary: dict[str, Any], pending: tuple[str, ...], strict: bool) -> Verdict:
    """Pure: a summary (`result.summarize`) and the plan's `auto` switches -> what `up` does. An `auto`
    switch is on only when it passed; a failing or unchecked switched-on patch goes off, or, under
    --strict-selfcheck, is a refusal."""
    bad = tuple(n for n in result.failed(summary) if n not in pending)
    loose = tuple(n for n in result.unchecked(summary) if n not in pending)
    passed = set(result.passed(summary))
    on = tuple(n for n in pending if n in passed)
    refuse = strict and bool(bad or loose)
    return Verdict(Decision(off=() if strict else bad, on=() if refuse else on), bad, loose,
                   tuple(n for n in pending if n not in passed), refuse)


def _checked(plan: Plan, strict: bool, run: RunDir, echo: Echo) -> Decision:
    summary = run_check(plan, run.path, echo)
    pending = set(plan.pending_patches)
    v = decide(summary, plan.pending_patches, strict)
    bad, loose, turned_on, kept_off, refuse = list(v.failed), list(v.unchecked), list(v.decision.on), \
        list(v.kept_off), v.refuse
    summary["decision"] = "refused" if refuse else "switched_off" if bad else "ok"
    summary["switched_off"] = [] if strict else bad
    summary["switched_on"] = turned_on
    summary["kept_off"] = kept_off
    result.write(run.path, summary)
    run.event("selfcheck", decision=summary["decision"], failed=bad, switched_off=summary["switched_off"],
              switched_on=summary["switched_on"], kept_off=kept_off, unchecked=loose,
              standin=summary.get("standin", False), seconds=summary.get("seconds"))
    echo(result.render(summary))
    action = ("--strict-selfcheck: refusing to start" if strict else
              "switched OFF for this run: SGLang's own function is used for it")
    for line in result.warnings(summary, action, pending=pending):
        echo(line)
    for name in turned_on:
        echo(f"kernel patch {name}: self-check passed on every GPU of the plan; switched ON for this run")
    if refuse:
        if bad:
            first = summary["patches"][bad[0]]
            what = f"failed for {', '.join(bad)} ({first['class']} on {first['where']}: {first['error']})"
        else:
            what = f"has no case for {', '.join(loose)} (switched on, unverified)"
        run.set_state(status="failed", stopped=time.time(), reason=f"kernel self-check {what}")
        raise RuntimeFailure(
            f"kernel self-check {what} and --strict-selfcheck is set; nothing was started",
            f"read {run.path / result.FILE} and the logs in {run.path / 'selfcheck'}; start without "
            "--strict-selfcheck to serve with the failing patch(es) switched off (or switch the unchecked ones "
            f"off: {' '.join(f'--{n.replace(chr(95), chr(45))} off' for n in bad + loose)}), and send us "
            "`v4flash-pd report`")
    return v.decision
