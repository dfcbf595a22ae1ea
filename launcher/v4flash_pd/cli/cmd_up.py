"""`v4flash-pd up`: resolve and preflight the plan, then run it (launch.py), here or detached."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import click

from v4flash_pd.cli.options import Options, Resolved, RunOptions, pass_options, resolve, run_options
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.fingerprint import fingerprint
from v4flash_pd.launch import Launch, run_launch
from v4flash_pd.poll import poll_until
from v4flash_pd.routerauth import read_key
from v4flash_pd.rundir import RunDir
from v4flash_pd.selfcheck.gate import gate as selfcheck_gate
from v4flash_pd.servecheck import missing as missing_stack


def preflight(r: Resolved, verify_model: str) -> None:
    """What the plan cannot know and must be refused before a process starts (the plan, built with
    starting=True, has already refused busy ports, a missing model dir and a missing router)."""
    plan = r.plan
    if not plan.rehearse and plan.workers():
        gone = missing_stack(plan.python, nixl=r.config.transfer_backend == "nixl")
        if gone:
            raise UserError(f"the serving stack is not installed for {plan.python}: {', '.join(gone)} missing, so every "
                            "worker would exit at once; nothing was started",
                            "install it with pip install '.[serve]' in the checkout (or pip install --require-hashes "
                            "-r stack.lock), or run the image (docker run ... v4flash-pd up); `up --rehearse` needs "
                            "none of it")
    if not plan.rehearse and verify_model != "off":
        from v4flash_pd.bundle.preflight import check_model_against_manifest, find_manifest

        model_dir = Path(r.config.model_path)
        if find_manifest(model_dir) is not None:
            problems = check_model_against_manifest(model_dir, full=verify_model == "full")
            if problems:
                raise UserError(
                    f"model dir {model_dir} does not match its manifest: " + "; ".join(problems[:5])
                    + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""),
                    "re-copy the named files from the bundle (a truncated shard is the classic air-gap "
                    "failure), then `v4flash-pd bundle verify DIR --model PATH --full`",
                )
    # the router's key, or (a cluster's box) the same key its workers take
    kind, where = plan.router_auth if plan.router_auth[0] else r.config.client_auth if plan.workers() else ("", "")
    if kind:
        read_key(kind, where)  # a missing/empty secret is refused now, not after the workers loaded


def check_writable(run: RunDir) -> None:
    """A run dir we cannot write would fail on the first log line, after processes started."""
    probe = run.path / ".write-test"
    try:
        probe.write_text("ok\n")
        probe.unlink()
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise UserError(f"cannot write the run dir {run.path}: {exc.strerror}; nothing was started",
                            f"free space in {run.path} (df -h {run.path}) or pass a --run-dir on another "
                            "filesystem") from None
        raise UserError(f"run dir {run.path} is not writable: {exc.strerror or exc}",
                        "pass a writable --run-dir, or set V4FLASH_RUNS_ROOT to a writable directory") from None


def _detach(launch: Launch, run: RunDir) -> None:
    """Hand the resolved launch and the run dir's lock to a background launcher in its own session,
    then wait for READY."""
    log = open(run.file("launcher.log"), "ab")
    lock = run.lock()  # ours since before the self-check: handed down, never released in between
    child = subprocess.Popen([sys.executable, "-m", "v4flash_pd.launch", str(run.path), "--lock-fd", str(lock)],
                             stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             pass_fds=(lock,))
    assert child.stdin is not None
    try:
        child.stdin.write(json.dumps(launch.to_dict()).encode())
        child.stdin.close()
    except BrokenPipeError:  # it died at once: its log says why (below)
        pass
    click.echo(f"launcher detached (pid {child.pid}); log {run.file('launcher.log')}")
    click.echo(f"its progress follows until READY; later: v4flash-pd logs launcher -f --run-dir {run.path}")
    shown = [0]

    def progress() -> None:
        """Echo what the launcher wrote since the last look (the first start takes tens of minutes)."""
        try:
            with open(run.file("launcher.log"), "rb") as f:
                f.seek(shown[0])
                chunk = f.read(1 << 20)
        except OSError:
            return
        done = chunk.rfind(b"\n") + 1  # whole lines only
        shown[0] += done
        for line in chunk[:done].decode("utf-8", "replace").splitlines():
            if not line.startswith("READY "):  # ours is printed below, once, as scripts expect
                click.echo(f"  | {line}")

    def settled() -> str | None:
        progress()
        # a reused run dir holds the previous run's state: only the child's own state counts
        st = run.state()
        mine = st.get("launcher_pid") == child.pid
        if mine and st.get("status") == "ready":
            return "ready"
        if child.poll() is not None or (mine and st.get("status") in ("failed", "stopped")):
            return "gone"
        return None

    got = poll_until(settled, launch.ready_timeout + 30, 0.1)
    if got == "ready":
        click.echo(f"READY {launch.plan.probe_url}  run dir {run.path}")
        return
    if got == "gone":
        tail = run.file("launcher.log").read_text(errors="replace").splitlines()[-30:]
        raise RuntimeFailure("the detached launcher stopped before READY:\n" + "\n".join("    | " + t for t in tail),
                             f"see {run.file('launcher.log')} and the role logs in {run.path}")
    raise RuntimeFailure(f"no READY within {launch.ready_timeout:.0f}s (launcher still running, pid {child.pid})",
                         f"watch `v4flash-pd status --run-dir {run.path}`, or `v4flash-pd down --run-dir {run.path}`")


@click.command("up", short_help="Start prefill + decode + router, gate on a real request, supervise.")
@run_options
@pass_options(run=True)
def command(opts: Options, how: RunOptions) -> None:
    """Start prefill + decode + router, wait until a real request works, supervise until stopped."""
    r = resolve(opts, "up")
    cfg = r.config
    preflight(r, how.verify_model)
    run = RunDir.create(how.run_dir)
    run.lock()  # before the self-check: a second `up` on this run dir is refused before it checks anything
    check_writable(run)
    # before any worker: a patch that fails its self-check is switched off (a typed flag beats every layer)
    try:
        decided = selfcheck_gate(r.plan, how.no_selfcheck, how.strict_selfcheck, run, click.echo)
    except OSError as exc:  # its records and logs go into the run dir (a full disk, say); it stopped its checks
        raise UserError(f"cannot write the kernel self-check's files in {run.path}: {exc.strerror or exc}; no worker "
                        "was started", f"free space in {run.path} (df -h {run.path}) or pass a --run-dir on another "
                        "filesystem") from None
    if decided.off or decided.on:
        changes = tuple((f"patches.{n}", "off") for n in decided.off) + tuple((f"patches.{n}", "on") for n in decided.on)
        r = resolve(replace(opts, flags=opts.flags + changes), "up")
        cfg = r.config
    launch = Launch(plan=r.plan, config=cfg.to_dict(), fingerprint=fingerprint(r.topology), grace=cfg.grace_period,
                    ready_timeout=cfg.ready_timeout, smoke_prompt=cfg.smoke_prompt, hang_timeout=cfg.hang_timeout,
                    eval_questions=how.eval_questions if how.eval_gate else 0,
                    eval_min_accuracy=how.eval_min_accuracy)
    if how.detach:
        _detach(launch, run)
        return
    run_launch(launch, run, echo=click.echo)
