"""`doctor --gpu`: the self-check as doctor rows, one per kernel patch the plan switches on."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from v4flash_pd.doctor.result import Check, error, ok, skip, warn
from v4flash_pd.plan import Plan
from v4flash_pd.selfcheck import result
from v4flash_pd.selfcheck.gate import patches_to_check, run_check


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def doctor_rows(plan: Plan, env: Mapping[str, str] | None = None,
                echo: Callable[[str], None] = _stderr) -> tuple[Check, ...]:
    """Run the self-check for the plan (progress on stderr) and turn it into rows; logs are kept only
    when something failed (their directory is named in the row)."""
    if not plan.workers():
        return (skip("selfcheck", "this part of the cluster plan starts no worker here"),)
    if not patches_to_check(plan):
        return (skip("selfcheck", "every kernel patch is switched off in this plan: nothing to check"),)
    out = Path(tempfile.mkdtemp(prefix="v4flash-selfcheck-"))
    try:
        summary = run_check(plan, out, echo, env)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    rows = rows_for(summary, out)
    if not result.failed(summary):
        shutil.rmtree(out, ignore_errors=True)
    return rows


def rows_for(summary: dict[str, Any], logs: Path) -> tuple[Check, ...]:
    tag = result.mark(summary)
    rows = []
    for name, p in summary.get("patches", {}).items():
        row = f"selfcheck-{name}"
        gpus = result.gpu_ranges(sorted(int(g) for g in p.get("gpus", {})))
        if p["status"] == result.FAIL:
            rows.append(error(row, f"FAILED on GPU {result.gpu_ranges(sorted(p['failed_gpus']))} ({p.get('class')}; "
                                   f"first: {p.get('where')}: {p.get('error')})" + (f" {tag}" if tag else ""),
                              f"`up` switches this patch off for its run by itself (--strict-selfcheck refuses "
                              f"instead); details in {logs}; please send us `v4flash-pd report`"))
        elif p["status"] == result.UNCHECKED:
            rows.append(warn(row, f"no self-check exists for this patch: it runs unverified on GPU {gpus}",
                             f"turn it off if in doubt (--{name.replace('_', '-')} off)"))
        else:
            rows.append(ok(row, f"passed on GPU {gpus}: {p.get('cases', 0)} case(s) each vs fp64"
                                + (f"; {p['upstream']}" if p.get("upstream") else "") + (f" {tag}" if tag else "")))
    return tuple(rows)
