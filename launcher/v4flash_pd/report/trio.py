"""Stop a variant's trio from what its run dir records, and say what (if anything) is left of it.

A variant's trio belongs to the background launcher its `up --detach` started (its own session, so
a Ctrl-C reaches neither). `stop` asks that launcher to stop it through `down` (which reads the run
dir's identities, signals the launcher, then any process group it left); a launcher that has not
recorded itself yet (the trio was starting) is found by its command line, `python -m
v4flash_pd.launch RUN_DIR`, and sent SIGTERM first. Every wait is bounded; what is still alive at
the end is returned, by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from v4flash_pd.poll import poll_until
from v4flash_pd.procgroup import PROC, Identity, Signaller, identify, read_cmdline
from v4flash_pd.rundir import RunDir

LAUNCH_MODULE = "v4flash_pd.launch"


def launchers(run_dir: Path, proc: Path = PROC) -> list[Identity]:
    """Live background launchers started for `run_dir`, found by their command line."""
    want = os.path.realpath(run_dir)
    found = []
    try:
        pids = [int(e.name) for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        cmd = read_cmdline(pid, proc)
        if len(cmd) >= 3 and cmd[-3:-1] == ("-m", LAUNCH_MODULE) and os.path.realpath(cmd[-1]) == want:
            ident = identify(pid, proc=proc)
            if ident is not None:
                found.append(ident)
    return found


def left(run_dir: Path, sig: Signaller | None = None) -> list[str]:
    """What of the trio is alive: every recorded process group, the launcher (recorded or found)."""
    sig = sig or Signaller()
    out = []
    if (run_dir / "state.json").is_file() or any(run_dir.glob("*.pid")):
        procs, launcher, _ = RunDir(run_dir).identities()
        out += [f"{name} (process group {i.pid})" for name, i in procs.items() if sig.alive(i)]
        if launcher is not None and sig.alive(launcher, group=False):
            out.append(f"launcher (pid {launcher.pid})")
    out += [f"launcher (pid {i.pid})" for i in launchers(run_dir) if f"launcher (pid {i.pid})" not in out]
    return out


def stop(run_dir: Path, env: Mapping[str, str], log: Path, timeout: float = 120.0, grace: float = 10.0) -> list[str]:
    """Stop everything of the trio in `run_dir` (`down`'s output appended to `log`); what is still alive."""
    sig = Signaller()
    early = launchers(run_dir)
    for ident in early:  # ask it as `down` would: it stops whatever it started, in order
        sig.send(ident, signal.SIGTERM, group=False)
    poll_until(lambda: not any(sig.alive(i, group=False) for i in early), timeout, 0.05)
    if (run_dir / "state.json").is_file():
        argv = [sys.executable, "-m", "v4flash_pd", "down", "--run-dir", str(run_dir), "--timeout", f"{timeout:g}",
                "--grace", f"{grace:g}"]
        with open(log, "a", encoding="utf-8") as out:
            try:  # its own session: a Ctrl-C at the terminal must not cut the stop short
                subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True,
                               timeout=timeout + grace + 30)
            except subprocess.TimeoutExpired:
                out.write(f"`down` did not finish in {timeout + grace + 30:g} s\n")
    poll_until(lambda: not left(run_dir, sig), 5.0, 0.05)
    return left(run_dir, sig)
