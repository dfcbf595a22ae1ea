"""`v4flash-pd up`: preflight, start the plan, gate readiness, supervise until stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from v4flash_pd.cli.options import Resolved, pass_params, plan_options, resolve
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.fingerprint import fingerprint
from v4flash_pd.ports import busy_ports
from v4flash_pd.render import plan_text
from v4flash_pd.rundir import RunDir
from v4flash_pd.supervisor import StopRequested, Supervisor


def preflight(r: Resolved, verify_model: str) -> None:
    """Everything that can be refused before a process starts (and before minutes of loading)."""
    plan = r.plan
    if not plan.rehearse:
        if not r.model.ok:
            raise UserError(f"{r.model.problem}; refusing to start",
                            "pass --model /path/to/DeepSeek-V4-Flash (a dir with config.json and the weights), "
                            "or mount it at the profile's path; `up --rehearse` runs without a model")
        if verify_model != "off":
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
    busy = busy_ports(plan.port_uses())
    if busy:
        raise UserError(
            "port(s) already in use on this host: "
            + ", ".join(f"{u.port} ({u.owner}{', ' + u.host if u.host else ''})" for u in busy),
            "stop whatever holds them (`v4flash-pd down`, or `ss -ltnp` to find it), or move the role to free "
            "ports, e.g. --set router.port=8001",
        )


def _detach(params: dict[str, Any], run: RunDir, ready_timeout: float) -> None:
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
    deadline = time.monotonic() + ready_timeout + 30
    while time.monotonic() < deadline:
        st = run.state()
        if st.get("status") == "ready":
            click.echo(f"READY {st.get('url')}  run dir {run.path}")
            return
        if child.poll() is not None or st.get("status") in ("failed", "stopped"):
            tail = run.file("launcher.log").read_text(errors="replace").splitlines()[-30:]
            raise RuntimeFailure("the detached launcher stopped before READY:\n" + "\n".join("    | " + t for t in tail),
                                 f"see {run.file('launcher.log')} and the role logs in {run.path}")
        time.sleep(0.2)
    raise RuntimeFailure(f"no READY within {ready_timeout:.0f}s (launcher still running, pid {child.pid})",
                         f"watch `v4flash-pd status --run-dir {run.path}`, or `v4flash-pd down --run-dir {run.path}`")


def _eval_gate(questions: int, min_accuracy: float):  # noqa: ANN202
    def gate(sup: Supervisor) -> None:
        from v4flash_pd.evalgate import render, run_eval

        sup.echo(f"accuracy gate: {questions} generated arithmetic problems through {sup.plan.probe_url}")
        res = run_eval(sup.plan.probe_url, questions, min_accuracy)
        sup.run.write_json("eval.json", res.to_dict())
        sup.echo(render(res))
        if not res.passed:
            raise RuntimeFailure(
                f"accuracy gate failed: {res.correct}/{res.total} correct ({res.accuracy:.0%} < {min_accuracy:.0%})",
                "answers are wrong while the servers look healthy: suspect KV transfer (NIXL/UCX env, "
                "sglang#23773-class bugs); compare with `--profile rtx6000-tp4` (no PD)",
            )
    return gate


@click.command("up")
@plan_options
@click.option("--rehearse", is_flag=True, envvar="V4FLASH_REHEARSE",
              help="Same plan, ports, env, numactl and router, with stand-in engines instead of SGLang.")
@click.option("--run-dir", type=click.Path(path_type=Path), envvar="V4FLASH_RUN_DIR",
              help="Where logs/pids/state go (default: $V4FLASH_RUNS_ROOT/<timestamp>, ./runs).")
@click.option("--ready-timeout", type=float, envvar="V4FLASH_READY_TIMEOUT",
              help="Seconds to wait for READY (default 3600: first DeepSeek-V4 start is slow).")
@click.option("--grace", type=float, envvar="V4FLASH_GRACE", help="Seconds between SIGTERM and SIGKILL.")
@click.option("--detach", is_flag=True, envvar="V4FLASH_DETACH", help="Return once READY; supervise in the background.")
@click.option("--eval", "eval_gate", is_flag=True, envvar="V4FLASH_EVAL", help="Run the accuracy gate before READY.")
@click.option("--eval-questions", type=int, default=20, show_default=True, envvar="V4FLASH_EVAL_QUESTIONS")
@click.option("--eval-min-accuracy", type=float, default=0.8, show_default=True, envvar="V4FLASH_EVAL_MIN_ACCURACY")
@click.option("--verify-model", type=click.Choice(["size", "full", "off"]), default="size", show_default=True,
              envvar="V4FLASH_VERIFY_MODEL", help="Check the model dir against its bundle manifest before start.")
@pass_params
def command(params: dict[str, Any]) -> None:
    """Start prefill + decode + router, wait until a real request works, supervise until stopped."""
    sets = list(params.get("sets") or ())
    if params.get("ready_timeout") is not None:
        sets.append(f"ready_timeout={params['ready_timeout']}")
    if params.get("grace") is not None:
        sets.append(f"grace_period={params['grace']}")
    params["sets"] = tuple(sets)
    r = resolve(params, rehearse=params["rehearse"], local=True, for_up=True)
    cfg, plan = r.config, r.plan
    preflight(r, params["verify_model"])
    run = RunDir.create(params.get("run_dir"))
    if params["detach"]:
        _detach(params, run, cfg.ready_timeout)
        return
    run.write_json("config.json", cfg.to_dict())
    run.write_json("plan.json", plan.to_dict())
    run.write_json("fingerprint.json", fingerprint(r.topology))
    click.echo(plan_text(plan, show_commands=False))
    click.echo(f"run dir  {run.path}")
    sup = Supervisor(plan, run, echo=lambda m: click.echo(m), grace=cfg.grace_period,
                     ready_timeout=cfg.ready_timeout, smoke_prompt=cfg.smoke_prompt,
                     after_ready=_eval_gate(params["eval_questions"], params["eval_min_accuracy"]) if params["eval_gate"] else None)
    sup.install_signal_handlers()
    t0 = time.monotonic()
    try:
        sup.start_and_wait_ready()
        click.echo(f"READY {plan.url} (took {time.monotonic() - t0:.1f}s; "
                   f"try: curl -H 'Content-Type: application/json' {plan.probe_url}/generate -d '{{\"text\":\"Hi\"}}')"
                   f"{' [rehearsal]' if plan.rehearse else ''}")
        sys.stdout.flush()
        sup.supervise()
    except StopRequested as stop:
        click.echo(f"received {stop}; stopping")
        sup.stop_all()
        run.set_state(status="stopped", stopped=time.time(), reason=str(stop))
        click.echo("stopped cleanly")
        return
    except RuntimeFailure as exc:
        sup.stop_all()
        run.set_state(status="failed", stopped=time.time(), reason=exc.message.splitlines()[0])
        raise
    except BaseException as exc:
        sup.stop_all()
        run.set_state(status="failed", stopped=time.time(), reason=repr(exc))
        raise
