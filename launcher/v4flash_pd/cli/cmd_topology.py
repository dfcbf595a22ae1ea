"""`v4flash-pd topology`: what this host looks like to the planner (and a file to plan with)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from v4flash_pd import topology as topo


@click.command("topology")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_JSON", help="Print JSON.")
@click.option("--save", type=click.Path(path_type=Path), envvar="V4FLASH_SAVE",
              help="Write the detected topology to FILE (usable as --topology FILE).")
def command(as_json: bool, save: Path | None) -> None:
    """Show detected GPUs, PCI bus ids, GPU->NUMA map and NUMA node CPUs."""
    t = topo.probe()
    if save:
        topo.save(t, save)
    if as_json:
        click.echo(json.dumps(t.to_dict(), indent=2))
    else:
        click.echo(f"source  {t.source}")
        click.echo(f"driver  {t.driver_version or '-'}")
        for g in t.gpus:
            node = "?" if g.numa_node < 0 else g.numa_node
            click.echo(f"GPU {g.index}  {g.bus_id}  numa {node}  sm {g.compute_cap or '?'}  {g.memory_mib} MiB  {g.name}")
        if not t.gpus:
            click.echo("no GPUs detected")
        for n in t.nodes:
            click.echo(f"node {n.id}  cpus {n.cpus}")
        for note in t.notes:
            click.echo(f"note: {note}")
    if save:
        click.echo(f"saved to {save}", err=True)
