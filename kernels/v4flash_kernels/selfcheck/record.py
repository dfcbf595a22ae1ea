"""The per-GPU result file the runner writes and the launcher reads (schema `v4flash.selfcheck.gpu/1`).

One JSON object per process, rewritten atomically after every case, so a process that hangs or
dies still leaves what it finished and what it was running (`running`):

    {"schema": "v4flash.selfcheck.gpu/1", "gpu": physical index | null, "pid": N, "device": {...}, "target": {...},
     "started": t, "seconds": s, "running": {"patch": "moe", "case": "M=32", "since": t} | null,
     "done": bool, "context_lost": bool, "interpreter": bool, "standin": bool,
     "patches": {"moe": {"status": "pass" | "fail" | "unchecked" | "running", "phase": "ours" | "upstream",
                         "class": str | null, "error": str | null, "seconds": s, "upstream": str,
                         "cases": [{"name", "size", "status": "pass" | "fail" | "skip", "class", "error",
                                    "seconds", "metrics", "graph", "upstream"}]}}}

A patch `fail`s when any case fails; `unchecked` means its registry entry names no self-check;
`running` is a patch the process was still checking (if it died then, `phase` says whether ours'
verdict was already complete: "upstream" = only upstream's comparisons were left).
`standin` marks the launcher's rehearsal stand-in (no GPU, nothing ran), which writes the same
format; `interpreter` a CPU run under Triton's interpreter. Stdlib only.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

SCHEMA = "v4flash.selfcheck.gpu/1"
PASS, FAIL, SKIP, UNCHECKED, RUNNING = "pass", "fail", "skip", "unchecked", "running"


def new(device: Dict[str, Any], target: Dict[str, Any], interpreter: bool) -> Dict[str, Any]:
    return {"schema": SCHEMA, "gpu": None, "pid": os.getpid(), "device": device, "target": target,
            "interpreter": interpreter, "standin": False,
            "started": time.time(), "seconds": 0.0, "running": None, "done": False, "context_lost": False,
            "patches": {}}


def patch_verdict(cases: List[Any]) -> str:
    """fail if any case failed; pass if at least one ran and none failed; skip if nothing ran."""
    statuses = [c.get("status") for c in cases]
    if FAIL in statuses:
        return FAIL
    return PASS if PASS in statuses else SKIP


def first_failure(cases: List[Any]) -> Dict[str, Any] | None:
    return next((c for c in cases if c.get("status") == FAIL), None)


def write(path: str | None, rec: Dict[str, Any]) -> None:
    """Atomic rewrite (a reader never sees half a file); no path = nothing to write."""
    if not path:
        return
    rec["seconds"] = round(time.time() - rec["started"], 3)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_scrub(rec), f, indent=1, default=str, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def _scrub(obj: Any) -> Any:
    """NaN/inf as strings: the file must stay strict JSON for any reader."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_scrub(v) for v in obj]
    return obj
