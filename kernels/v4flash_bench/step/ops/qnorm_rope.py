"""The fused q path of the step (`qnorm_rope`): wq_b's block-FP8 GEMM + per-head RMSNorm + RoPE in one kernel.

Ours only: upstream runs this as two ops, the block-FP8 linear ("wq_b (FP8)") and the JIT
`fused_q_norm_rope` ("q norm + RoPE (JIT)", a proxy: it needs SGLang's CUDA JIT), which are the upstream
path's rows; the patched path has this one row at decode and verify rows (up to 16). Called as SGLang calls
the patch, `MQALayer._compute_q_b(self, q, positions, q_out)`, on a layer whose wq_b runs our linear, with
q_out the padded 64-head q's slice of rank 0 (as `MQALayer.forward` passes it at attention-TP > 1).

Checked against fp64 of the definitions within `qnorm_rope.reference.error_bound` (the fp8 accumulation,
the bf16 roundings at upstream's three points); the unfused composition it replaces (our linear, then a
torch statement of the JIT kernel) is held to the same bound on the same inputs and reported.
"""

from __future__ import annotations

import torch

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import common as C
from v4flash_bench.step.ops.common import Check, Prepared, Unavailable
from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.qnorm_rope import reference as R
from v4flash_kernels.qnorm_rope.selfcheck import mqa_layer
from v4flash_kernels.qnorm_rope.upstream import unfused

POSITIONS = 131072  # the rotation table's length (each row reads one 256-byte row of it)
EPS = 1e-6


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    if impl != "ours":
        raise Unavailable("upstream runs wq_b and the JIT fused_q_norm_rope as two ops (their rows of its path)")
    fn, why = C.patch_function("qnorm_rope")
    if fn is None:
        raise Unavailable(why)
    p = op.p
    m, heads, k = C.int_param(p, "m"), C.int_param(p, "heads"), C.int_param(p, "k")
    n = heads * R.HEAD_DIM
    g = C.gen(seed)
    r = C.rotations(n * k, l2)
    freqs = R.make_freqs_cis(POSITIONS, device=C.DEVICE)
    x = R.make_activation(m, k, g, device=C.DEVICE)
    pos = R.make_positions(m, POSITIONS, g, device=C.DEVICE)
    layers = [mqa_layer(*R.make_weight(n, k, g, device=C.DEVICE), heads, freqs, EPS) for _ in range(r)]
    padded = torch.empty((m, M.N_HEADS, R.HEAD_DIM), dtype=torch.bfloat16, device=C.DEVICE)
    q_out = padded[:, :heads]

    def one(i: int) -> None:
        fn(layers[i % r], x, pos, q_out)

    def run() -> None:
        for layer in layers:
            fn(layer, x, pos, q_out)

    def check() -> Check:
        layer = layers[0]
        w, ws = layer.wq_b.weight, layer.wq_b.weight_scale_inv
        args = (x, w, ws, heads, EPS, freqs, pos)
        gpu = C.DEVICE == "cuda"
        ref = R.qnorm_rope_ref(*args)
        bound = R.error_bound(*args, bf16_unit=R.BF16_RN if gpu else R.BF16_TRUNC, acc=R.ACC if gpu else R.ACC_IEEE)
        out = fn(layer, x, pos, q_out)
        ex = R.excess(out, ref, bound)
        comp = unfused(*args)
        ex_u = R.excess(comp, ref, bound)
        detail = (f"vs fp64: {ex:.2f} of the rounding bound; the unfused composition {ex_u:.2f}, "
                  f"rel. err between them {rel_err(out, comp):.1e}")
        return Check(ex <= 1.0, rel_err(out, ref), detail)

    return Prepared(run, r, check, "ours: v4flash_kernels.qnorm_rope.op.compute_q_b (wq_b GEMM + norm + RoPE, "
                    "one kernel)", one)
