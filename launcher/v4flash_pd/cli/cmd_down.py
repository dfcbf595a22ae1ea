"""`v4flash-pd down`: stop a run started by `up` (detached or in another terminal)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import click

from v4flash_pd.procs import group_alive, pid_alive, signal_group
from v4flash_pd.rundir import RunDir


@click.command("down")
@click.option("--run-dir", type=click.Path(path_type=Path), envvar="V4FLASH_RUN_DIR", help="Run dir (default: latest).")
@click.option("--timeout", type=float, default=60.0, show_default=True, envvar="V4FLASH_DOWN_TIMEOUT",
              help="Seconds to wait for the launcher's graceful stop before killing the groups directly.")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_JSON")
def command(run_dir: Path | None, timeout: float, as_json: bool) -> None:
    """Gracefully stop the launcher (which stops router, decode, prefill in that order)."""
    run = RunDir.find(run_dir)
    st = run.state()
    pid = int(st.get("launcher_pid") or 0)
    how = "already stopped"
    if pid and pid_alive(pid) and st.get("status") not in ("stopped", "failed"):
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + timeout
        while time.monotonic() < end and pid_alive(pid) and run.state().get("status") not in ("stopped", "failed"):
            time.sleep(0.2)
        how = "launcher stopped the run" if run.state().get("status") in ("stopped", "failed") else "launcher did not stop in time"
    leftovers = []
    for name, p in (st.get("pids") or {}).items():
        if group_alive(int(p)):
            leftovers.append(name)
            if signal_group(int(p), signal.SIGTERM):
                time.sleep(2.0)
                signal_group(int(p), signal.SIGKILL)
    if leftovers:
        how += f"; killed leftover process groups: {', '.join(leftovers)}"
        run.set_state(status="stopped", stopped=time.time(), reason="down (killed leftovers)")
    result = {"run_dir": str(run.path), "result": how, "status": run.state().get("status")}
    click.echo(json.dumps(result) if as_json else f"{run.path}: {how}")
