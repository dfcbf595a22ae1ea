"""`v4flash-pd plan`: show exactly what `up` would start, without starting anything."""

from __future__ import annotations

import json

import click

from v4flash_pd import docformat, exposure
from v4flash_pd import topology as topo
from v4flash_pd.cli.common import json_option
from v4flash_pd.cli.options import (
    Options,
    cluster_options,
    config_options,
    hosts_option,
    load,
    pass_options,
    prepare,
    resolve,
)
from v4flash_pd.cluster import part_plans
from v4flash_pd.render import cluster_text, plan_text


@click.command("plan", short_help="Show what `up` would start (argv, env, NUMA, ports), starting nothing.")
@config_options
@cluster_options
@hosts_option
@click.option("--rehearse", is_flag=True, envvar="V4FLASH_REHEARSE", help="Plan the rehearsal (stand-in engines).")
@json_option("Print the plan as JSON.")
@pass_options()
def command(opts: Options, as_json: bool) -> None:
    """Print the resolved plan: per-role argv, env, NUMA binding, ports, kernel patches and auth.

    Without --topology it plans this host (its GPUs, numactl permissions, busy ports, model dir);
    with --topology FILE it plans the box that file describes and uses nothing of this one. A cluster
    (--boxes N, or [cluster] in the config) is shown part by part: each box's plan and the router's,
    as each box's `up` would build them (with --topology, or the slots' GPUs, for every box).
    """
    cfg = load(opts)
    if cfg.cluster is not None:
        topology = topo.load(opts.topology_file) if opts.topology_file else None
        parts = part_plans(cfg, topology, rehearse=opts.rehearse)
        if as_json:
            d = docformat.stamp(docformat.CLUSTER_VIEW, {"parts": {name: p.to_dict() for name, p in parts},
                                                         "config": cfg.to_dict(),
                                                         "exposure": {name: exposure.lines(p) for name, p in parts}})
            click.echo(json.dumps(d, indent=2))
            return
        click.echo(cluster_text(cfg, parts))
        return
    r = resolve(opts, "plan", prepare(opts, "plan", cfg))  # the config is built once
    if as_json:
        d = r.plan.to_dict()
        d["config"] = r.config.to_dict()
        d["exposure"] = exposure.lines(r.plan)
        click.echo(json.dumps(d, indent=2))
        return
    click.echo(plan_text(r.plan))
