"""`v4flash-pd doctor`: check this box against the Plan `up` would start; one table, a fix per finding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from v4flash_pd import exposure
from v4flash_pd.cli.common import json_option
from v4flash_pd.cli.options import Options, RunOptions, pass_options, prepare, resolve, run_options
from v4flash_pd.doctor import (
    FAMILIES,
    Check,
    DoctorInput,
    exit_code,
    expect_from_plan,
    render_table,
    run_checks,
    system_probe,
    to_json,
)
from v4flash_pd.doctor.rehearsal import relax
from v4flash_pd.errors import UserError
from v4flash_pd.plan import Plan, PlanWarning, WarningCode
from v4flash_pd.rundir import RunDir
from v4flash_pd.selfcheck.rows import doctor_rows
from v4flash_pd.topology import probe as probe_topology

# Plan warnings that a check family reports in its own row (with its own fix): not repeated in `plan`.
COVERED: dict[WarningCode, str] = {
    "topology-note": "gpu", "gpus-missing": "gpu",
    "numa-unbindable": "numa", "numa-preferred": "numa", "numa-cpu-only": "numa",
    "ports-busy": "ports", "router-open": "ports",
    "model-missing": "model",
    "memory-unfit": "memory", "memory-tight": "memory",
}
ROUTER_ONLY_FAMILIES = ("ports", "storage", "stack")


def running_ports(run_dir: Path | None) -> dict[int, str]:
    """The ports of the run that is up (the --run-dir given, else the latest one): port -> "the running
    rehearsal DIR" (or run)."""
    try:
        run = RunDir.find(run_dir)
    except UserError:
        return {}
    what = f"the running {'rehearsal' if run.is_rehearsal() else 'run'} {run.path}"
    return dict.fromkeys(run.live_ports(), what)


def plan_row(warnings: tuple[PlanWarning, ...]) -> Check:
    rest = [w.text for w in warnings if w.code not in COVERED]
    if rest:
        return Check("plan", "warn", "; ".join(rest), "see `v4flash-pd plan` for the whole plan and adjust the config")
    return Check("plan", "ok", "the plan `up` would start builds on this box")


def exposure_row(plan: Plan) -> Check:
    """What listens beyond this box unauthenticated (the router's own row is router-auth)."""
    open_ = [x for x in exposure.unguarded(plan) if x.owner not in ("router http", "KV transfer")]
    if open_:
        return Check("exposure", "warn", "reachable from other machines WITHOUT authentication: "
                     + "; ".join(f"{x.owner} on {x.where}" for x in open_), exposure.advice(plan))
    said = exposure.lines(plan)
    return Check("exposure", "ok", "; ".join(said) if said else "nothing listens beyond this box")


@click.command("doctor", short_help="Check this box against the plan `up` would start (same options as up).")
@run_options
@click.option("--only", default="", envvar="V4FLASH_DOCTOR_ONLY",
              help="Comma-separated check families to run: gpu,numa,ports,model,memory,storage,stack,transport,offline.")
@json_option("Machine-readable output.")
@click.option("--gpu", "gpu_selfcheck", is_flag=True, envvar="V4FLASH_DOCTOR_GPU",
              help="Also run the kernel self-check on the plan's GPUs (one row per patch; compiles and runs every "
                   "patch, about a minute).")
@pass_options(run=True)
def command(opts: Options, how: RunOptions, only: str, as_json: bool, gpu_selfcheck: bool) -> None:
    """Check this box against the plan: driver/CUDA 13, GPUs, NUMA bindings (the plan's own numactl
    prefixes), ports, model files, disk, /dev/shm, pinned versions, each kernel patch, context length,
    NIXL/UCX, GPU peer access, offline env, router authentication.

    Takes exactly `up`'s options, so `v4flash-pd doctor <up's options>` checks what that `up` would run.

    Exit code: 0 all ok, 3 warnings, 4 errors (2 = the options or config themselves are wrong).
    """
    families = tuple(f.strip() for f in only.split(",") if f.strip())
    known = [n for n, _ in FAMILIES]
    bad = [f for f in families if f not in known]
    if bad:
        raise UserError(f"unknown check family {', '.join(bad)}", f"use some of: {', '.join(known)}")
    cfg, host = prepare(opts, "doctor")  # a cluster plan: the part this box starts
    probe = system_probe()
    try:
        plan = resolve(opts, "doctor", (cfg, host)).plan
    except UserError as exc:  # the plan itself cannot be built here: that is the finding
        checks: tuple[Check, ...] = (Check("plan", "error", exc.message, exc.hint),)
    else:
        expect = expect_from_plan(plan, host, numa_mode=cfg.numa, tokenizer_path=cfg.tokenizer_path,
                                  transfer_backend=cfg.transfer_backend)
        inp = DoctorInput(expect=expect, topology=host.topology, probe=probe, topology_is_local=opts.topology_file is None,
                          running=running_ports(how.run_dir))
        # a cluster's router part starts no worker here: GPUs, NUMA, model and KV transport are the boxes'
        chosen = families or (ROUTER_ONLY_FAMILIES if not plan.workers() else ())
        if opts.rehearse:  # one family at a time: what a rehearsal does not need is shown, not counted
            checks = tuple(relax(name, c) for name, fn in FAMILIES if not chosen or name in chosen
                           for c in run_checks(inp, families=[(name, fn)]))
        else:
            checks = run_checks(inp, only=chosen)
        if not families:
            checks = (plan_row(plan.warnings), exposure_row(plan)) + checks
        if gpu_selfcheck:  # it runs on this machine's GPUs, whatever --topology describes
            here = host.topology if opts.topology_file is None else probe_topology()
            checks += doctor_rows(plan, visible=[g.index for g in here.gpus])
    if as_json:
        click.echo(json.dumps(to_json(checks), indent=2))
    else:
        click.echo(f"doctor: profile {cfg.profile}, topology {host.topology.source}")
        click.echo(render_table(checks))
    sys.exit(exit_code(checks))
