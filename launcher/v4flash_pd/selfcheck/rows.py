"""`doctor --gpu`: the self-check as doctor rows, one per kernel patch the plan switches on."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from v4flash_pd.doctor.result import Check, error, ok, skip, warn
from v4flash_pd.plan import Plan
from v4flash_pd.selfcheck import result
from v4flash_pd.selfcheck.gate import check_seams, patches_to_check, plan_gpus, run_check


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def doctor_rows(plan: Plan, env: Mapping[str, str] | None = None,
                echo: Callable[[str], None] = _stderr, visible: Iterable[int] | None = None) -> tuple[Check, ...]:
    """Run the self-check for the plan (progress on stderr) and turn it into rows; logs are kept only
    when something failed (their directory is named in the row). `visible`: this machine's GPUs (None:
    not known); a check on the GPUs needs every one the plan uses, else one row says what is missing
    and nothing runs (a check process per absent GPU would only report that torch sees no GPU)."""
    if not plan.workers():
        return (skip("selfcheck", "this part of the cluster plan starts no worker here"),)
    if not patches_to_check(plan):
        return (skip("selfcheck", "every kernel patch is switched off in this plan: nothing to check"),)
    here = None if visible is None else sorted(set(visible))
    need = plan_gpus(plan)
    on_gpus = not plan.rehearse and check_seams(os.environ if env is None else env) == "cuda"
    if on_gpus and here is not None and not set(need) <= set(here):
        fix = ("run `v4flash-pd doctor --gpu` on the GPU box the plan is for (the gpu rows say what this one "
               "lacks); `doctor --gpu --rehearse` rehearses the check here without a GPU")
        if not here:
            return (error("selfcheck", "no GPU on this machine (nvidia-smi lists none): the self-check did not run",
                          fix),)
        return (error("selfcheck", f"the plan uses GPUs {result.gpu_ranges(need)} but this machine has "
                                   f"{result.gpu_ranges(here)}: the self-check did not run",
                      fix + ", or pick this machine's GPUs in the config (e.g. --set prefill.0.gpus=[0,1])"),)
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
