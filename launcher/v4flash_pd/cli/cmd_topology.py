"""`v4flash-pd topology`: what this host looks like to the planner (and a file to plan with)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from v4flash_pd import topology as topo
from v4flash_pd.cli.common import json_option
from v4flash_pd.table import format_table


@click.command("topology")
@json_option("Print JSON.")
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
        if t.gpus:
            rows = [(str(g.index), g.bus_id, "?" if g.numa_node < 0 else str(g.numa_node), g.compute_cap or "?",
                     f"{g.memory_mib} MiB", g.name) for g in t.gpus]
            for line in format_table(("GPU", "BUS ID", "NUMA", "SM", "MEMORY", "NAME"), rows):
                click.echo(line)
        else:
            click.echo("no GPUs detected")
        for line in format_table(("NODE", "CPUS"), [(str(n.id), n.cpus) for n in t.nodes]) if t.nodes else []:
            click.echo(line)
        for note in t.notes:
            click.echo(f"note: {note}")
    if save:
        click.echo(f"saved to {save}", err=True)
