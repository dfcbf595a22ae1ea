"""`v4flash-pd down`: stop a run started by `up` (detached or in another terminal).

It asks the launcher first (SIGTERM: the launcher stops router, decode, prefill in order and records
it), then stops whatever is left itself. Every signal goes through `procgroup.Signaller`, which
checks the recorded identity (pid + start time + command line) first: a pid that now belongs to
someone else, pid <= 1 and our own process group are never signalled.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import click

from v4flash_pd.poll import poll_until
from v4flash_pd.procgroup import Identity, Signaller, describe_state
from v4flash_pd.rundir import RunDir


def _wait_gone(sig: Signaller, idents: list[Identity], timeout: float) -> bool:
    return bool(poll_until(lambda: not any(sig.alive(i) for i in idents), timeout, 0.05))


@click.command("down")
@click.option("--run-dir", type=click.Path(path_type=Path), envvar="V4FLASH_RUN_DIR", help="Run dir (default: latest).")
@click.option("--timeout", type=float, default=60.0, show_default=True, envvar="V4FLASH_DOWN_TIMEOUT",
              help="Seconds to wait for the launcher's graceful stop before stopping the groups directly.")
@click.option("--grace", type=float, default=10.0, show_default=True, envvar="V4FLASH_DOWN_GRACE",
              help="Seconds between SIGTERM and SIGKILL for process groups the launcher left behind.")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_JSON")
def command(run_dir: Path | None, timeout: float, grace: float, as_json: bool) -> None:
    """Gracefully stop the launcher (which stops router, decode, prefill in that order)."""
    run = RunDir.find(run_dir)
    procs, launcher, source = run.identities()
    sig = Signaller()
    notes: list[str] = []
    if source != "state.json":
        notes.append(f"identities from {source}")
    st0, _ = run.read_state()
    how = "already stopped" if st0.get("status") in ("stopped", "failed") else "launcher was not running"
    if launcher is not None:
        res = sig.send(launcher, signal.SIGTERM, group=False)
        if res == "sent":
            # a stopped (SIGSTOP) launcher only handles its SIGTERM once continued
            sig.send(launcher, signal.SIGCONT, group=False)
            poll_until(lambda: not sig.alive(launcher, group=False), timeout, 0.05)
            gone = not sig.alive(launcher, group=False)
            how = "launcher stopped the run" if gone else "launcher did not stop in time"
        elif res == "refused":
            notes.append(f"launcher not signalled: {sig.refusals[-1]}")
    leftovers = [n for n, i in procs.items() if sig.alive(i)]
    killed: list[str] = []
    refused: set[str] = set()
    for name in leftovers:
        if sig.send(procs[name], signal.SIGTERM) == "refused":
            refused.add(name)
            notes.append(f"{name} not signalled: {sig.refusals[-1]}")
    leftovers = [n for n in leftovers if n not in refused]
    pending = [procs[n] for n in leftovers]
    if pending and not _wait_gone(sig, pending, grace):
        for name in leftovers:
            if sig.alive(procs[name]) and sig.send(procs[name], signal.SIGKILL) == "sent":
                killed.append(name)
        _wait_gone(sig, pending, 5.0)
    stopped = [n for n in leftovers if not sig.alive(procs[n])]
    if stopped:
        how += f"; stopped leftover process groups: {', '.join(stopped)}"
        how += f" (SIGKILL: {', '.join(killed)})" if killed else ""
    still = [n for n in leftovers if sig.alive(procs[n])]
    launcher_left = launcher is not None and sig.alive(launcher, group=False)
    if launcher_left:  # it holds the run dir's lock and may still restart or record things
        assert launcher is not None
        state = describe_state(launcher.pid)
        still.append(f"launcher (pid {launcher.pid})")
        notes.append(f"the launcher (pid {launcher.pid}{', ' + state if state else ''}) did not stop within "
                     f"--timeout {timeout:g}s and still holds {run.file('.lock')}: run `down` again with a longer "
                     f"--timeout, or look at it (py-spy dump --pid {launcher.pid}); kill -9 {launcher.pid} as a "
                     "last resort")
    if (stopped or how == "launcher did not stop in time") and not launcher_left:
        try:
            run.set_state(status="stopped", stopped=time.time(), reason="down" + (" (stopped leftovers)" if stopped else ""))
        except OSError as exc:
            notes.append(f"cannot record the stop in state.json: {exc.strerror}")
    st, _ = run.read_state()
    result = {"run_dir": str(run.path), "result": how, "status": st.get("status"), "notes": notes,
              "still_running": still}
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"{run.path}: {how}")
        for n in notes:
            click.echo(f"  note: {n}")
        for n in still:
            click.echo(f"  WARNING {n} is still running")
    if still:
        raise SystemExit(1)
