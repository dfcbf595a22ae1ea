"""`python -m v4flash_pd.rehearsal.selfcheck <the kernel self-check's argv>`: the rehearsal's stand-in.

A rehearsal has no GPU, so `up --rehearse` runs this instead of `v4flash_kernels.selfcheck`, in the
same interpreter and environment, with the same arguments, one process per GPU of the plan, and
writes the same per-GPU record, marked `"standin": true` with one `stand-in` case per patch and a
device named "stand-in". Every switch passes, except one whose registry entry names no self-check
(reported `unchecked`, as the real check would) and what `V4FLASH_SELFCHECK_INJECT` breaks (the
real check's test seam, same grammar): those fail with the class the real check would report, and
`launch` (a lost CUDA context), `hang` and `crash` behave as the real process would, so the
launcher's whole path (restarts, timeouts, switching patches off) is rehearsed too. Stdlib only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from v4flash_kernels.selfcheck import inject, record

CLASS_OF = {"wrong": "wrong_result", "compile": "compile_error", "resource": "resource_error",
            "launch": "launch_error"}
WHY = {"wrong": "rel. error 0.5 > 0.01 (injected)",
       "compile": "CompilationError: deliberately uncompilable kernel (injected)",
       "resource": "OutOfResources: out of resource: shared memory (injected)",
       "launch": "CUDA error: an illegal memory access was encountered (injected)"}


def _module_of(switch: str) -> str | None:
    """The switch's self-check module in the registry (stdlib-only import); unknown switches count as checked."""
    from v4flash_kernels.hook.patches import switch_by_name

    try:
        module: str | None = switch_by_name(switch).selfcheck
    except KeyError:
        return "unknown"
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_pd.rehearsal.selfcheck")
    ap.add_argument("--json", default=None)
    ap.add_argument("--patches", default="")
    ap.add_argument("--gpu", type=int, default=None)
    args, rest = ap.parse_known_args(argv)
    try:
        broken = inject.from_env(gpu=args.gpu)
    except ValueError as exc:
        print(f"error: {exc}\nfix: unset {inject.ENV} (it is a test seam)", file=sys.stderr)
        return 2
    rec = record.new({"name": "stand-in (rehearsal: no GPU, no kernel ran)", "device": "none"},
                     {"argv": rest}, interpreter=False)
    rec.update(gpu=args.gpu, standin=True)
    record.write(args.json, rec)
    for name in (p.strip() for p in args.patches.split(",") if p.strip()):
        kind = broken.get(name)
        if _module_of(name) is None:
            rec["patches"][name] = {"status": record.UNCHECKED, "phase": "ours", "class": None, "seconds": 0.0,
                                    "error": "its registry entry names no self-check module", "module": None,
                                    "injected": kind, "cases": [], "upstream": ""}
            record.write(args.json, rec)
            continue
        case: dict[str, Any] = {"name": "stand-in", "size": "none", "status": record.PASS, "class": None,
                                "error": None, "seconds": 0.0, "metrics": {}, "graph": None, "upstream": None}
        entry: dict[str, Any] = {"status": record.RUNNING, "phase": "ours", "class": None, "error": None,
                                 "seconds": 0.0, "module": None, "injected": kind, "cases": [],
                                 "upstream": "stand-in: upstream not run"}
        rec["patches"][name] = entry
        rec["running"] = {"patch": name, "case": "stand-in", "since": time.time()}
        record.write(args.json, rec)
        if kind == "hang":
            while True:
                time.sleep(3600)
        if kind == "crash":
            sys.stdout.flush()
            os.abort()
        if kind in CLASS_OF:
            case.update(status=record.FAIL, error=WHY[kind], **{"class": CLASS_OF[kind]})
        entry["cases"].append(case)
        entry["status"] = record.FAIL if kind in CLASS_OF else record.PASS
        if kind in CLASS_OF:
            entry.update(error=f"stand-in: {case['error']}", **{"class": case["class"]})
        record.write(args.json, rec)
        if kind == "launch":
            rec["context_lost"] = True
            break
    rec["running"] = None
    rec["done"] = not rec["context_lost"]
    record.write(args.json, rec)
    if rec["context_lost"]:
        return 3
    return 1 if any(p["status"] == record.FAIL for p in rec["patches"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
