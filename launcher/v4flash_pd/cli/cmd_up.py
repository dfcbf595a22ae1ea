"""`v4flash-pd up`: preflight, start the plan, gate readiness, supervise until stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from v4flash_pd.cli.options import Resolved, pass_params, resolve, run_options
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.fingerprint import fingerprint
from v4flash_pd.hostprobe import numactl_prefix
from v4flash_pd.plan import Plan
from v4flash_pd.poll import poll_until
from v4flash_pd.render import plan_text
from v4flash_pd.rundir import RunDir
from v4flash_pd.selfcheck.gate import gate as selfcheck_gate
from v4flash_pd.supervisor import StopRequested, Supervisor


def preflight(r: Resolved, verify_model: str) -> None:
    """What the plan cannot know and must be refused before a process starts (the plan, built with
    starting=True, has already refused busy ports, a missing model dir and a missing router)."""
    plan = r.plan
    if not plan.rehearse and plan.workers():
        from v4flash_pd.servecheck import missing

        python = plan.workers()[0].argv[len(numactl_prefix(plan.workers()[0].binding, r.host.numactl))]
        gone = missing(python, nixl=r.config.transfer_backend == "nixl")
        if gone:
            raise UserError(f"the serving stack is not installed for {python}: {', '.join(gone)} missing, so every "
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
        from v4flash_pd.routerauth import read_key

        read_key(kind, where)  # a missing/empty secret is refused now, not after the workers loaded


def check_writable(run: RunDir) -> None:
    """A run dir we cannot write would fail on the first log line, after processes started."""
    probe = run.path / ".write-test"
    try:
        probe.write_text("ok\n")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"run dir {run.path} is not writable: {exc.strerror or exc}",
                        "pass a writable --run-dir, or set V4FLASH_RUNS_ROOT to a writable directory") from None


def _detach(params: dict[str, Any], run: RunDir, ready_timeout: float, url: str) -> None:
    """Re-exec this same `up` in its own session with the run dir fixed, then wait for READY."""
    argv = [a for a in sys.argv[1:] if a != "--detach"]
    if "--run-dir" not in argv:
        argv += ["--run-dir", str(run.path)]
    env = dict(os.environ)
    env.pop("V4FLASH_DETACH", None)
    log = open(run.file("launcher.log"), "ab")
    child = subprocess.Popen([sys.executable, "-m", "v4flash_pd", *argv], env=env, stdin=subprocess.DEVNULL,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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

    got = poll_until(settled, ready_timeout + 30, 0.1)
    if got == "ready":
        click.echo(f"READY {url}  run dir {run.path}")
        return
    if got == "gone":
        tail = run.file("launcher.log").read_text(errors="replace").splitlines()[-30:]
        raise RuntimeFailure("the detached launcher stopped before READY:\n" + "\n".join("    | " + t for t in tail),
                             f"see {run.file('launcher.log')} and the role logs in {run.path}")
    raise RuntimeFailure(f"no READY within {ready_timeout:.0f}s (launcher still running, pid {child.pid})",
                         f"watch `v4flash-pd status --run-dir {run.path}`, or `v4flash-pd down --run-dir {run.path}`")


def _stdout_lost(run: RunDir, exc: OSError) -> None:
    """stdout went away before any worker started: record the stop, say so on stderr, exit 1 (as the
    supervisor does for a closed stdout later on), and keep the exiting interpreter off the dead pipe."""
    why = exc.strerror or str(exc)
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass
    try:
        run.set_state(status="stopped", stopped=time.time(), reason=f"stdout closed ({why})")
    except OSError:
        pass
    try:
        print(f"error: stdout closed ({why}) before any worker started; nothing was started", file=sys.stderr,
              flush=True)
    except OSError:
        pass
    raise SystemExit(1)


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


def _eval_gate(questions: int, min_accuracy: float):
    def gate(sup: Supervisor) -> None:
        from v4flash_pd.evalgate import render, run_eval
        from v4flash_pd.routerauth import auth_headers

        sup.echo(f"accuracy gate: {questions} generated arithmetic problems through {sup.plan.probe_url}")
        res = run_eval(sup.plan.probe_url, questions, min_accuracy, headers=auth_headers(sup.plan.router_auth))
        sup.run.write_json("eval.json", res.to_dict())
        sup.echo(render(res))
        if not res.passed:
            raise RuntimeFailure(
                f"accuracy gate failed: {res.correct}/{res.total} correct ({res.accuracy:.0%} < {min_accuracy:.0%})",
                "answers are wrong while the servers look healthy: suspect KV transfer (NIXL/UCX env, "
                "sglang#23773-class bugs); compare with `--profile rtx6000-tp4` (no PD)",
            )
    return gate


@click.command("up", short_help="Start prefill + decode + router, gate on a real request, supervise.")
@run_options
@pass_params
def command(params: dict[str, Any]) -> None:
    """Start prefill + decode + router, wait until a real request works, supervise until stopped."""
    r = resolve(params, "up")
    cfg, plan = r.config, r.plan
    preflight(r, params["verify_model"])
    run = RunDir.create(params.get("run_dir"))
    check_writable(run)
    try:  # before any worker: a failing patch is switched off (or refused)
        r = selfcheck_gate(r, params, run, click.echo)
    except BrokenPipeError as exc:  # stdout closed (`up | head`) while it reported: stop as the supervisor would
        _stdout_lost(run, exc)
    except OSError as exc:  # its records and logs go into the run dir (a full disk, say); it stopped its checks
        raise UserError(f"cannot write the kernel self-check's files in {run.path}: {exc.strerror or exc}; no worker "
                        "was started", f"free space in {run.path} (df -h {run.path}) or pass a --run-dir on another "
                        "filesystem") from None
    cfg, plan = r.config, r.plan
    if params["detach"]:
        _detach(params, run, cfg.ready_timeout, plan.probe_url)
        return
    run.lock()  # held until this process exits: a second `up` on this run dir is refused
    for name, doc in (("config.json", cfg.to_dict()), ("plan.json", plan.to_dict()),
                      ("fingerprint.json", fingerprint(r.topology))):
        try:  # nothing has started yet: a full or failing disk is refused here, before any process
            run.write_json(name, doc)
        except OSError as exc:
            raise UserError(f"cannot write {run.file(name)}: {exc.strerror or exc}; nothing was started",
                            f"free space in {run.path} (df -h {run.path}) or pass a --run-dir on another "
                            "filesystem") from None
    sup = Supervisor(plan, run, echo=lambda m: click.echo(m), grace=cfg.grace_period,
                     ready_timeout=cfg.ready_timeout, smoke_prompt=cfg.smoke_prompt, hang_timeout=cfg.hang_timeout,
                     after_ready=(_eval_gate(params["eval_questions"], params["eval_min_accuracy"])
                                  if params["eval_gate"] else None))
    sup.install_signal_handlers()  # SIGTERM, SIGINT and SIGHUP
    sup.say(plan_text(plan, show_commands=False))  # say: a closed stdout stops the run, it never orphans it
    sup.say(f"run dir  {run.path}")
    t0 = time.monotonic()
    try:
        sup.start_and_wait_ready()
        sup.say(ready_line(plan, time.monotonic() - t0))
        sup.supervise()
    except StopRequested as stop:
        sup.stop_all()  # signals first; every write below is best effort
        sup.ignore_stop_signals()
        sup.set_state(status="stopped", stopped=time.time(), reason=str(stop))
        sup.say(f"received {stop}; stopped cleanly")
        if stop.exit_code:
            try:
                print(f"error: {stop}; stopped every process of {run.path}", file=sys.stderr, flush=True)
            except OSError:
                pass
            raise SystemExit(stop.exit_code) from None
        return
    except RuntimeFailure as exc:
        sup.stop_all()
        sup.set_state(status="failed", stopped=time.time(), reason=exc.message.splitlines()[0])
        raise
    except BaseException as exc:
        sup.stop_all()
        sup.set_state(status="failed", stopped=time.time(), reason=repr(exc))
        raise
