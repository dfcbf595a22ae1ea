"""The compressors of a decode step, fused: our one kernel per compressor, checked against fp64.

Upstream runs each compressor as two rows of the step (its cuBLAS wkv_gate GEMM, a bf16 GEMM row, and
its compress + norm/RoPE + store JIT launches, a glue proxy row); the patched path's row is ours alone
(`model.fused_compressors`). Ours is called as the model calls it (`backend.forward_core_compressor(x,
forward_batch, layer_id, compressor)` on stand-ins of SGLang's objects), each call of a timed replay
on its own weights (past L2, as a real step streams each layer's) and its own ring, at consecutive
positions from one call to the next, so windows complete in about 1 / ratio of the rows as they do
step after step.
"""

from __future__ import annotations

from typing import Any, Dict, List

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import common as C
from v4flash_bench.step.ops.common import Check, Prepared, Unavailable
from v4flash_kernels.compressor.reference import check_step, make_case, step_ref
from v4flash_kernels.compressor.sglang_objects import objects


def positions(rows: int, ratio: int, seed: int, step: int) -> List[int]:
    """seq_len of each row at call `step`: each request a few windows in, at its own offset in the window."""
    return [ratio * (3 + b) + (37 * b + seed) % ratio + step + 1 for b in range(rows)]


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    if impl != "ours":
        raise Unavailable("upstream runs it as its wkv_gate GEMM row and its compress + store row")
    fn, why = C.patch_function(str(op.patch))
    if fn is None:
        raise Unavailable(why)
    p = op.p
    rows, ratio, hd = C.int_param(p, "rows"), C.int_param(p, "ratio"), C.int_param(p, "head_dim")
    n = 2 * (2 if ratio == 4 else 1) * hd
    r = C.rotations(n * M.HIDDEN * 2, l2)
    calls: List[Dict[str, Any]] = []
    for i in range(r):
        case = make_case(rows, ratio, hd, M.HIDDEN, seed + i, C.DEVICE, seq_lens=positions(rows, ratio, seed, i))
        calls.append(objects(case))

    def one(i: int) -> None:
        fn(**calls[i % len(calls)])

    def run() -> None:
        for kw in calls:
            fn(**kw)

    def check() -> Check:
        """A fresh step on which every other row completes its window: the ring and the stored tokens
        against fp64 within their rounding bounds (`reference.check_step`)."""
        seqs = [ratio * (2 + b) if b % 2 == 0 else ratio * (2 + b) + 1 for b in range(rows)]
        case = make_case(rows, ratio, hd, M.HIDDEN, seed + 999, C.DEVICE, seq_lens=seqs)
        ref = step_ref(case)
        before = case["cache"].cpu().clone()
        fn(**objects(case))
        C.sync()
        ok, metrics, why = check_step(case, ref, case["state"], case["cache"], before)
        detail = f"vs fp64: ring {metrics['state_excess']:.2f}, stored tokens {metrics['store_excess']:.2f} of " \
                 f"their rounding bounds, {metrics['rows_completed']} window(s)" + (f"; {why}" if why else "")
        return Check(ok, float(metrics["store_rel_err"]), detail)

    return Prepared(run, r, check, why + " (one kernel: wkv_gate GEMV + ring + pooling + norm/RoPE + FP8 store)",
                    one)
