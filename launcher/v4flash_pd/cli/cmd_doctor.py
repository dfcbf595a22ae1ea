"""`v4flash-pd doctor`: one table of checks with a fix for each failure; exit 0 ok / 1 warn / 2 error."""

from __future__ import annotations

import json
import sys

import click


@click.command("doctor")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, envvar="V4FLASH_CONFIG",
              help="Config file (TOML) whose plan the box is checked against.")
@click.option("--profile", default=None, envvar="V4FLASH_PROFILE", help="Built-in profile (default: rtx6000-8x-pd).")
@click.option("--topology", "topology_file", type=click.Path(dir_okay=False), default=None,
              envvar="V4FLASH_TOPOLOGY",
              help="Check against a saved topology (JSON from `v4flash-pd topology --save`) instead of probing.")
@click.option("--model", default=None, envvar="V4FLASH_MODEL", help="Model directory (overrides model.path).")
@click.option("--only", default="", envvar="V4FLASH_DOCTOR_ONLY",
              help="Comma-separated check families to run: gpu,numa,ports,model,storage,stack,transport,offline.")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_DOCTOR_JSON", help="Machine-readable output.")
def command(config_file: str | None, profile: str | None, topology_file: str | None, model: str | None,
            only: str, as_json: bool) -> None:
    """Check this box against the plan: driver/CUDA 13, GPUs, NUMA, numactl, ports, model files,
    disk, /dev/shm, pinned versions, kernel patch, NIXL/UCX, GPU peer access, offline env.

    Exit code: 0 all ok, 1 warnings, 2 errors.
    """
    from v4flash_pd import topology as topo_mod
    from v4flash_pd.config import load_config
    from v4flash_pd.doctor import (DoctorInput, FAMILIES, exit_code, expect_from_config, render_table,
                                   run_checks, system_probe, to_json)
    from v4flash_pd.errors import UserError

    families = tuple(f.strip() for f in only.split(",") if f.strip())
    known = [n for n, _ in FAMILIES]
    bad = [f for f in families if f not in known]
    if bad:
        raise UserError(f"unknown check family {', '.join(bad)}", f"use some of: {', '.join(known)}")
    overrides = {"model.path": model} if model else None
    cfg = load_config(config_file, profile, overrides=overrides)
    probe = system_probe()
    topo = topo_mod.load(topology_file) if topology_file else topo_mod.probe(probe.env)
    inp = DoctorInput(expect=expect_from_config(cfg), topology=topo, probe=probe,
                      topology_is_local=topology_file is None)
    checks = run_checks(inp, only=families)
    if as_json:
        click.echo(json.dumps(to_json(checks), indent=2))
    else:
        click.echo(f"doctor: profile {cfg.profile}, topology {topo.source}")
        click.echo(render_table(checks))
    sys.exit(exit_code(checks))
