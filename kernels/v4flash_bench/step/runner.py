"""Check then time every distinct op shape once (CUDA-graph replay, L2 flushed), then compose.

Each shape (op key) is measured once per implementation and reused by every composition that
contains it, so the slow upstream shapes (MoE at prefill M, the torch indexer at 1M) cost one
measurement each. Repetitions are capped by count and by time.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from v4flash_bench.step import model as M
from v4flash_bench.step import ops as O
from v4flash_bench.step.ops.common import Unavailable, op_seed
from v4flash_bench.step.results import Measurement, all_ok, impls_for, path_times, to_json
from v4flash_kernels.kit.measure import time_replay

__all__ = ["Measurement", "all_ok", "impls_for", "path_times", "to_json", "measure_all", "measure_one", "run"]


def measure_one(op: M.Op, impl: str, l2: int, seed: int) -> Measurement:
    base: Dict[str, Any] = {"key": op.key, "impl": impl, "name": op.name}
    try:
        prep = O.build(op, impl, l2, seed)
    except Unavailable as exc:
        return Measurement(**base, us=float("nan"), calls_per_replay=0, reps=0, ok=True, rel_err=float("nan"),
                           detail="", source=str(exc), error=str(exc))
    except Exception as exc:
        return Measurement(**base, us=float("nan"), calls_per_replay=0, reps=0, ok=False, rel_err=float("nan"),
                           detail="", source="build failed", error=f"{type(exc).__name__}: {exc}")
    try:
        chk = prep.check()
        if not chk.ok:
            return Measurement(**base, us=float("nan"), calls_per_replay=prep.calls, reps=0, ok=False,
                               rel_err=chk.rel_err, detail=chk.detail, source=prep.source,
                               error=f"MISMATCH vs reference: rel err {chk.rel_err:.3e} {chk.detail}")
        kernels = count_kernels(prep)
        us, reps = time_replay(prep.run, prep.calls)
        return Measurement(**base, us=us, calls_per_replay=prep.calls, reps=reps, ok=True, rel_err=chk.rel_err,
                           detail=chk.detail, source=prep.source, kernels=kernels)
    except Exception as exc:  # reported per op; the run goes on and exits non-zero
        return Measurement(**base, us=float("nan"), calls_per_replay=0, reps=0, ok=False, rel_err=float("nan"),
                           detail="", source=prep.source, error=f"{type(exc).__name__}: {exc}")
    finally:
        del prep
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def count_kernels(prep: Any) -> float:
    """Kernel nodes per call: one capture of `run()` (its `calls` calls), counted (NaN where this torch
    cannot keep a captured graph: the counts are then missing, never guessed)."""
    from v4flash_kernels.kit.graphnodes import kernels_in

    try:
        return float(kernels_in(prep.run).kernels / prep.calls)
    except Exception:
        return float("nan")


def measure_all(ops: Dict[str, M.Op], seed: int, log: Callable[[str], None] = print) -> Dict[Tuple[str, str], Measurement]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    out: Dict[Tuple[str, str], Measurement] = {}
    t0 = time.time()
    for key, op in ops.items():
        for impl in impls_for(op):
            m = measure_one(op, impl, l2, op_seed(seed, key))
            out[(key, impl)] = m
            state = (f"{m.us:10.1f} us  err {m.rel_err:.1e}" if m.error is None else f"  -- {m.error}")
            log(f"[{time.time() - t0:6.1f}s] {impl:8s} {key:45s}{state}")
    return out


def run(specs: List[M.StepSpec], seed: int, log: Callable[[str], None]=print) -> Any:
    ops = M.unique_ops(specs)
    meas = measure_all(ops, seed, log)
    return ops, meas
