"""Cross-compile every kernel binary the dispatchers can launch for sm_120 and sm_90, no GPU needed.

Why: see `kit.crosscompile`. Each kernel switch of the patch registry names its op folder's compile
list (`Switch.compile`: a module whose `binaries(arch)` compiles every config that op can launch); this
gate runs them all and fails on more than 101376 B of shared memory per block on sm_120, any register
spill, a table's recorded shared size that differs, or PTX that lacks what a protocol relies on.

    python -m v4flash_kernels.check_sm120 [--arch 120 --arch 90] [--only SWITCH] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from dataclasses import asdict
from typing import List, Sequence

from v4flash_kernels.hook.patches import SWITCHES
from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult


def compile_lists(only: Sequence[str] | None = None) -> List[str]:
    """The registry's compile-list modules, in registry order (`only`: just those switches')."""
    return [s.compile for s in SWITCHES if s.compile is not None and (only is None or s.name in only)]


def check(archs: Sequence[int] = (120, 90), only: Sequence[str] | None = None) -> List[CompileResult]:
    """Compile every op's binaries (or only those of the switches in `only`) for `archs`."""
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="v4flash-triton-"))
    results: List[CompileResult] = []
    for arch in archs:
        for module in compile_lists(only):
            results += importlib.import_module(module).binaries(arch)
    return results


def check_parallel(archs: Sequence[int], jobs: int, only: Sequence[str] | None = None) -> List[CompileResult]:
    """`check`, one process per arch (up to `jobs`): compiling is CPU-bound and one arch's ~180 binaries
    are independent of the other's, so CI's two cores halve the wall time."""
    jobs = max(1, min(jobs, len(archs)))
    if jobs == 1:
        return check(archs, only)
    import concurrent.futures
    import multiprocessing

    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="v4flash-triton-"))
    ctx = multiprocessing.get_context("spawn")  # no forked Triton/LLVM state
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        per_arch = list(pool.map(_check_one_arch, archs, [only] * len(archs)))
    return [r for rs in per_arch for r in rs]


def _check_one_arch(arch: int, only: Sequence[str] | None) -> List[CompileResult]:
    return check((arch,), only)


def format_table(results: Sequence[CompileResult]) -> str:
    head = f"{'kernel':<15} {'config':<36} {'arch':>5} {'smem B':>8} {'limit':>7} {'regs':>5} {'spill st/ld':>12}  ok"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.kernel:<15} {r.config:<36} {'sm_' + str(r.arch):>5} {r.shared_bytes:>8} {r.smem_limit:>7} "
            f"{r.registers:>5} {f'{r.spill_stores}/{r.spill_loads}':>12}  {'yes' if r.ok else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_kernels.check_sm120", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, action="append", help="SM arch (default: 120 and 90)")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--only", action="append", choices=[s.name for s in SWITCHES if s.compile is not None],
                    help="just this switch's kernels (a quick check while editing one op); repeatable")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="compile the archs in this many processes (default: the CPU count; 1 = in this one)")
    args = ap.parse_args(argv)
    archs = tuple(args.arch or (120, 90))
    results = check_parallel(archs, args.jobs, args.only)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(asdict(r), ok=r.ok) for r in results], f, indent=1)
    bad = [r for r in results if not r.ok]
    for r in bad:
        if r.ptx_problem:
            print(f"{r.kernel} {r.config} sm_{r.arch}: {r.ptx_problem}", file=sys.stderr)
    if bad:
        print(f"FAIL: {len(bad)} config(s) exceed shared memory, spill registers or differ from the "
              "table's recorded shared_bytes (the dispatcher's occupancy choice relies on it)", file=sys.stderr)
        return 1
    print(f"OK: {len(results)} kernel configs fit (sm_120 limit {SMEM_LIMIT[120]} B, no spills)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
