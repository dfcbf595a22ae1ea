"""`v4flash-pd status`: what a run dir says, checked against live pids and /health."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from v4flash_pd.httpcheck import request
from v4flash_pd.procs import pid_alive
from v4flash_pd.rundir import RunDir


def collect(run: RunDir) -> dict[str, Any]:
    st = run.state()
    try:
        plan = run.read_json("plan.json")
    except (OSError, ValueError):
        plan = {"processes": []}
    procs = []
    for p in plan.get("processes", []):
        pid = (st.get("pids") or {}).get(p["name"])
        alive = bool(pid) and pid_alive(int(pid))
        health = request(p["health_url"], timeout=1.0).status if alive else 0
        procs.append({"name": p["name"], "role": p["role"], "pid": pid, "alive": alive, "health": health,
                      "gpus": p["gpus"], "numa": p["binding"]})
    launcher = int(st.get("launcher_pid") or 0)
    return {"run_dir": str(run.path), "status": st.get("status", "unknown"), "url": st.get("url"),
            "launcher_pid": launcher, "launcher_alive": bool(launcher) and pid_alive(launcher),
            "ready_seconds": st.get("ready_seconds"), "reason": st.get("reason"),
            "processes": procs, "kernel_patch": run.patch_status()}


@click.command("status")
@click.option("--run-dir", type=click.Path(path_type=Path), envvar="V4FLASH_RUN_DIR", help="Run dir (default: latest).")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_JSON")
def command(run_dir: Path | None, as_json: bool) -> None:
    """Show run state, each process's pid/liveness/health and the kernel patch status."""
    info = collect(RunDir.find(run_dir))
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"run     {info['run_dir']}")
    click.echo(f"status  {info['status']}{'' if info['launcher_alive'] or info['status'] in ('stopped', 'failed') else ' (launcher not running!)'}")
    click.echo(f"url     {info['url']}")
    if info.get("reason"):
        click.echo(f"reason  {info['reason']}")
    for p in info["processes"]:
        health = {200: "healthy", 0: "-"}.get(p["health"], f"HTTP {p['health']}")
        click.echo(f"  {p['name']:<11} pid {p['pid'] or '-':<8} {'up' if p['alive'] else 'down':<5} {health}")
    for s in info["kernel_patch"]:
        click.echo(f"  kernel patch pid {s.get('pid')}: {'active' if s.get('active') else 'inactive'} {s.get('reason', '')}")
