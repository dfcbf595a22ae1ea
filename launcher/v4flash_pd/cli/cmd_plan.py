"""`v4flash-pd plan`: show exactly what `up` would start, without starting anything."""

from __future__ import annotations

import json
from typing import Any

import click

from v4flash_pd.cli.options import pass_params, plan_options, resolve
from v4flash_pd.ports import busy_ports
from v4flash_pd.render import plan_text


@click.command("plan")
@plan_options
@click.option("--rehearse", is_flag=True, envvar="V4FLASH_REHEARSE", help="Plan the rehearsal (stand-in engines).")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_JSON", help="Print the plan as JSON.")
@pass_params
def command(params: dict[str, Any]) -> None:
    """Print the resolved plan: per-role argv, env, NUMA binding and ports."""
    r = resolve(params, rehearse=params["rehearse"])
    plan = r.plan
    warnings = list(plan.warnings)
    if params.get("topology_file") is None:  # planning this host: say which ports are taken now
        warnings += [f"port {u.port} ({u.owner}) is in use on this host now; `up` will refuse it"
                     for u in busy_ports(plan.port_uses())]
    if params["as_json"]:
        d = plan.to_dict()
        d["warnings"] = warnings
        d["config"] = r.config.to_dict()
        click.echo(json.dumps(d, indent=2))
        return
    from dataclasses import replace

    click.echo(plan_text(replace(plan, warnings=tuple(warnings))))
