"""`v4flash-pd logs ROLE`: tail (and follow) one process's log from the run dir."""

from __future__ import annotations

from pathlib import Path

import click

from v4flash_pd.errors import UserError
from v4flash_pd.poll import poll_until
from v4flash_pd.rundir import RunDir


def _roles(run: RunDir) -> dict[str, str]:
    """name -> role from the plan the run executed (names are labels, not parsed)."""
    try:
        plan = run.read_json("plan.json")
        return {str(p["name"]): str(p["role"]) for p in plan.get("processes", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def resolve_name(run: RunDir, role: str) -> str:
    names = sorted(p.stem for p in run.path.glob("*.log") if p.stem != "launcher")
    if role in names or role == "launcher" and run.file("launcher.log").exists():
        return role
    roles = _roles(run)
    matches = [n for n in names if roles.get(n) == role]
    if len(matches) == 1:
        return matches[0]
    raise UserError(f"no single log for {role!r} in {run.path}" + (f" (matches: {', '.join(matches)})" if matches else ""),
                    f"use one of: {', '.join(names) or '(no logs yet)'}")


@click.command("logs")
@click.argument("role")
@click.option("--run-dir", type=click.Path(path_type=Path), envvar="V4FLASH_RUN_DIR", help="Run dir (default: latest).")
@click.option("-n", "--lines", "n", type=int, default=50, show_default=True, envvar="V4FLASH_LINES")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the run stops (or Ctrl-C).")
def command(role: str, run_dir: Path | None, n: int, follow: bool) -> None:
    """Print the last N lines of ROLE's log (prefill, decode, router, or a name like decode-0)."""
    run = RunDir.find(run_dir)
    name = resolve_name(run, role)
    for line in run.tail(name, n):
        click.echo(line)
    if not follow:
        return
    path = run.log(name)
    stop = b"\0stop"

    with open(path, "rb") as f:
        f.seek(0, 2)

        def next_chunk() -> bytes | None:
            chunk = f.readline()
            if chunk:
                return chunk
            return stop if run.state().get("status") in ("stopped", "failed") else None

        while True:
            chunk = poll_until(next_chunk, 3600.0, 0.3)
            if chunk == stop:
                return
            if chunk:
                click.echo(chunk.decode("utf-8", "replace").rstrip("\n"))
