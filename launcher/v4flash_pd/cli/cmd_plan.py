"""`v4flash-pd plan`: show exactly what `up` would start, without starting anything."""

from __future__ import annotations

import json
from typing import Any

import click

from v4flash_pd import exposure
from v4flash_pd.cli.options import cluster_options, config_from_params, config_options, pass_params, resolve
from v4flash_pd.render import cluster_text, plan_text


@click.command("plan", short_help="Show what `up` would start (argv, env, NUMA, ports), starting nothing.")
@config_options
@cluster_options
@click.option("--hosts", envvar="V4FLASH_CLUSTER_HOSTS",
              help="Cluster plans: the boxes' host names in box order (default: box-0, box-1, ...).")
@click.option("--rehearse", is_flag=True, envvar="V4FLASH_REHEARSE", help="Plan the rehearsal (stand-in engines).")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_JSON", help="Print the plan as JSON.")
@pass_params
def command(params: dict[str, Any]) -> None:
    """Print the resolved plan: per-role argv, env, NUMA binding, ports, kernel patches and auth.

    Without --topology it plans this host (its GPUs, numactl permissions, busy ports, model dir);
    with --topology FILE it plans the box that file describes and uses nothing of this one. A cluster
    (--boxes N, or [cluster] in the config) is shown part by part: each box's plan and the router's,
    as each box's `up` would build them (with --topology, or the slots' GPUs, for every box).
    """
    cfg = config_from_params(params)
    if cfg.cluster is not None:
        from v4flash_pd import topology as topo
        from v4flash_pd.cluster import part_plans

        tfile = params.get("topology_file")
        parts = part_plans(cfg, topo.load(tfile) if tfile else None, rehearse=bool(params.get("rehearse")))
        if params["as_json"]:
            d = {"format": "v4flash-pd/cluster-view/1", "parts": {name: p.to_dict() for name, p in parts},
                 "config": cfg.to_dict(), "exposure": {name: exposure.lines(p) for name, p in parts}}
            click.echo(json.dumps(d, indent=2))
            return
        click.echo(cluster_text(cfg, parts))
        return
    r = resolve(params, "plan", cfg)  # the config is built once
    if params["as_json"]:
        d = r.plan.to_dict()
        d["config"] = r.config.to_dict()
        d["exposure"] = exposure.lines(r.plan)
        click.echo(json.dumps(d, indent=2))
        return
    click.echo(plan_text(r.plan))
