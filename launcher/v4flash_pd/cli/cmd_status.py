"""`v4flash-pd status`: what a run dir says, checked against live processes and their health endpoints.

Liveness comes from the recorded identities (a reused pid is not "up"), health from one short
probe each: "not listening" (connection refused) and "not answering" (connected, no reply: hung or
stopped) are different failures and are reported as such.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import click

from v4flash_pd.cli.common import json_option
from v4flash_pd.diskwatch import full_note
from v4flash_pd.httpclient import REFUSED, TIMEOUT, Probes
from v4flash_pd.poll import poll_until
from v4flash_pd.procgroup import Identity, Signaller, describe_state, read_stat
from v4flash_pd.rundir import RunDir
from v4flash_pd.safety import escape_controls

PROBE_TIMEOUT = 1.0


def _health_words(alive: bool, status: int, kind: str, proc_state: str) -> str:
    if not alive:
        return "-"
    if proc_state and proc_state != "gone":
        return f"not answering ({proc_state})"
    if status == 200:
        return "healthy"
    if status:
        return f"HTTP {status}"
    if kind == TIMEOUT:
        return f"not answering (no reply within {PROBE_TIMEOUT:g}s)"
    if kind == REFUSED:
        return "not listening"
    return "no answer"


def _worker_of(pid: Any, procs: dict[str, Identity]) -> str | None:
    if not isinstance(pid, int):
        return None
    st = read_stat(pid)
    by_group = {i.pid: n for n, i in procs.items()}
    if pid in by_group:
        return by_group[pid]
    return by_group.get(st.pgrp) if st is not None else None


def _plan(run: RunDir) -> tuple[dict[str, Any], str]:
    """(plan.json, problem): the processes `status` lists, each with the fields it reads; a missing
    plan (nothing was planned yet) is no problem, a forged or broken one is said, not raised."""
    try:
        plan = run.read_json("plan.json")
    except FileNotFoundError:
        return {"processes": []}, ""
    except OSError as exc:
        return {"processes": []}, f"cannot read plan.json: {exc.strerror or exc}"
    except ValueError as exc:
        return {"processes": []}, f"plan.json is corrupt ({exc})"
    if not isinstance(plan, dict):
        return {"processes": []}, "plan.json is corrupt (not a JSON object)"
    procs = plan.get("processes", [])
    fields = ("name", "role", "health_url")
    if not isinstance(procs, list) or not all(isinstance(p, dict) and all(isinstance(p.get(f), str) for f in fields)
                                              for p in procs):
        return {**plan, "processes": []}, ("plan.json is corrupt (processes is not a list of tables with "
                                           f"{', '.join(fields)})")
    return plan, ""


def collect(run: RunDir) -> dict[str, Any]:
    st, problem = run.read_state()
    idents, launcher, source = run.identities()
    plan, plan_problem = _plan(run)
    sig = Signaller()
    rows = []
    probes = Probes()
    for p in plan["processes"]:
        ident = idents.get(p["name"])
        alive = ident is not None and sig.alive(ident)
        rows.append((p, ident, alive))
        if alive:
            probes.start(p["name"], p["health_url"], PROBE_TIMEOUT, 0.0)
    poll_until(lambda: not probes.in_flight, PROBE_TIMEOUT + 1.0, 0.02)
    replies = {name: rep for name, _, rep in probes.results()}
    procs = []
    for p, ident, alive in rows:
        rep = replies.get(p["name"])
        status = rep.status if rep is not None else 0
        kind = rep.kind if rep is not None else TIMEOUT
        proc_state = describe_state(ident.pid) if alive and ident is not None else ""
        procs.append({"name": p["name"], "role": p["role"], "pid": ident.pid if ident else None, "alive": alive,
                      "health": status if alive else 0, "answer": _health_words(alive, status, kind, proc_state),
                      "gpus": p.get("gpus"), "numa": p.get("binding")})
    launcher_alive = launcher is not None and sig.alive(launcher, group=False)
    patches = run.patch_status()
    for rec in patches:
        rec["worker"] = _worker_of(rec.get("pid"), idents)
    full = full_note(run.path) if launcher_alive else ""  # state.json cannot say it on a full disk
    url = st.get("url")
    # a wildcard listener's URL (http://0.0.0.0:8000) is where it listens, not where to connect:
    # show the plan's address for this box instead, as READY does
    reach = plan.get("probe_url") if isinstance(url, str) and re.match(r"https?://(0\.0\.0\.0|\[::\])[:/]", url) \
        else None
    recorded_pid = st.get("launcher_pid")
    return {"run_dir": str(run.path), "status": str(st.get("status", "unknown")), "degraded": full,
            "url": reach or url, "listening": url if reach else None, "selfcheck": _selfcheck(run, st),
            "state_problem": problem, "plan_problem": plan_problem, "identities_from": source,
            "launcher_pid": launcher.pid if launcher else recorded_pid if isinstance(recorded_pid, int) else 0,
            "launcher_alive": launcher_alive,
            "ready_seconds": st.get("ready_seconds"), "reason": st.get("reason"),
            "processes": procs, "kernel_patch": patches}


@click.command("status")
@click.option("--run-dir", type=click.Path(path_type=Path), envvar="V4FLASH_RUN_DIR", help="Run dir (default: latest).")
@json_option()
def command(run_dir: Path | None, as_json: bool) -> None:
    """Show run state, each process's pid/liveness/health and each kernel patch per worker."""
    info = collect(RunDir.find(run_dir))
    if as_json:  # JSON escapes every control character itself
        click.echo(json.dumps(info, indent=2))
        return

    def say(line: str) -> None:
        """One line of what the run dir says: its files are anyone's who can write there, so no control
        character of theirs reaches the terminal."""
        click.echo(escape_controls(line))

    say(f"run     {info['run_dir']}")
    stopped = info["status"] in ("stopped", "failed")
    say(f"status  {info['status']}{'' if info['launcher_alive'] or stopped else ' (launcher not running!)'}"
        + (f" (DEGRADED: {info['degraded']})" if info["degraded"] else ""))
    source = info["identities_from"]
    if info["state_problem"]:
        say(f"note    {info['state_problem']}; identities from {source}")
    elif source != "state.json":  # e.g. state.json's procs entry unreadable: said by identities()
        say(f"note    {source if ';' in source else 'identities from ' + source}")
    if info["plan_problem"]:
        say(f"note    {info['plan_problem']}; its processes are not listed")
    say(f"url     {info['url']}" + (f"   (listening on {info['listening']})" if info.get("listening") else ""))
    if info.get("reason"):
        say(f"reason  {info['reason']}")
    for p in info["processes"]:
        say(f"  {p['name']:<11} pid {p['pid'] or '-':<8} {'up' if p['alive'] else 'down':<5} {p['answer']}")
    sc = info.get("selfcheck")
    if sc is not None:
        for line in sc.get("lines") or [f"kernel self-check: {sc.get('error')}"]:
            say(f"  {line}")
    for rec in info["kernel_patch"]:
        who = f"{rec.get('worker') or '?'} pid {rec.get('pid')}"
        if rec.get("error"):
            say(f"  kernel patches {who}: {rec['error']} ({rec.get('file')}" + (f": {rec['why']})" if rec.get("why")
                                                                                 else ")"))
        for name, p in sorted(rec.get("patches", {}).items()):
            say(f"  kernel patch {name:<14} {who}: {'active' if p.get('active') else 'inactive'}"
                + (f" ({p['reason']})" if p.get("reason") else ""))


def _selfcheck(run: RunDir, state: dict[str, Any]) -> dict[str, Any] | None:
    """The run's kernel self-check (selfcheck.json), if it ran: verdicts and what `up` did about them;
    or why this run skipped it (state.json's selfcheck_skipped)."""
    from v4flash_pd.selfcheck import result

    path = run.file(result.FILE)
    if not os.path.lexists(path):
        skipped = state.get("selfcheck_skipped")
        if isinstance(skipped, str) and skipped:
            return {"skipped": skipped, "lines": [f"kernel self-check skipped ({skipped}): the patches run unverified"]}
        return None
    try:
        summary = result.load(path)
    except ValueError as exc:
        return {"error": str(exc), "lines": [f"WARNING kernel self-check result unreadable: {exc}"]}
    return {**result.brief(summary), "lines": result.status_lines(summary)}
