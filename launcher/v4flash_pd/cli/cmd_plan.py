"""`v4flash-pd plan`: show exactly what `up` would start, without starting anything."""

from __future__ import annotations

import json
from typing import Any

import click

from v4flash_pd.cli.options import config_options, pass_params, resolve
from v4flash_pd.render import plan_text


@click.command("plan", short_help="Show what `up` would start (argv, env, NUMA, ports), starting nothing.")
@config_options
@click.option("--rehearse", is_flag=True, envvar="V4FLASH_REHEARSE", help="Plan the rehearsal (stand-in engines).")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_JSON", help="Print the plan as JSON.")
@pass_params
def command(params: dict[str, Any]) -> None:
    """Print the resolved plan: per-role argv, env, NUMA binding, ports, kernel patches and auth.

    Without --topology it plans this host (its GPUs, numactl permissions, busy ports, model dir);
    with --topology FILE it plans the box that file describes and uses nothing of this one.
    """
    r = resolve(params, "plan")
    if params["as_json"]:
        d = r.plan.to_dict()
        d["config"] = r.config.to_dict()
        click.echo(json.dumps(d, indent=2))
        return
    click.echo(plan_text(r.plan))
