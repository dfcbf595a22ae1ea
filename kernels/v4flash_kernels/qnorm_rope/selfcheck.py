"""Self-check cases of the q norm + RoPE fusion (`qnorm_rope`): see v4flash_kernels.selfcheck.

Each case calls the installed drop-in, `MQALayer._compute_q_b(self, q, positions, q_out)`, on a layer
as SGLang builds it with the `fp8_gemm` patch active (wq_b's quant method dispatching block linears to
our `w8a8_block_fp8_linear`, 128x128 blocks, no bias; 512-dim heads, 64-dim RoPE), so the fused kernel
is what runs (a call it refused would go to upstream's method, which the self-check process does not
have: the case fails). Production shapes: DeepSeek-V4-Flash's wq_b (K = q_lora_rank 1024) at this
worker's TP and at TP4 and TP2 (64 / tp heads), at every decode and verify row count the fused path
takes (1..16; larger batches run upstream's method, nothing of ours), `q_out` the strided slice of the
padded 64-head q that `MQALayer.forward` passes at TP > 1 (the other heads poisoned and checked
untouched); the largest is also captured in a CUDA graph and replayed.

Ours is held to `reference.error_bound` around the fp64 reference (fp32 accumulation of the fp8
products, bf16 at upstream's three rounding points). "Upstream" here is the unfused composition the
fusion replaces when wq_b is our linear: our block-FP8 linear, then a torch statement of upstream's JIT
`fused_q_norm_rope` (`qnorm_rope.upstream`; the JIT kernel itself needs SGLang's CUDA JIT), held to the
same bound; the record also shows how far ours is from it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Tuple

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, registry_function

PATCH = "qnorm_rope"
N_HEADS = 64  # DeepSeek-V4-Flash's attention heads (n_local_heads = 64 / attention TP)
Q_LORA = 1024  # wq_b's K (the only K the fused path takes: op.FUSED_K)
EPS = 1e-6  # rms_norm_eps
MAX_ROWS = 16  # what the fused path takes (op.MAX_ROWS); kept literal: building cases imports no kernel


def cases(target: Target) -> List[Case]:
    out = [_case("small T=3 2 heads", SMALL, target, 3, 2, 1, 0),
           _case("small T=5 heads 2-3 of 4 (strided q_out, int32 positions)", SMALL, target, 5, 4, 2, 1, int32=True)]
    if target.small_only:
        return out
    rows = [m for m in target.decode_rows if 1 <= m <= MAX_ROWS]
    tps = [tp for tp in dict.fromkeys((max(1, target.tp_size), 4, 2)) if N_HEADS % tp == 0]
    for tp in tps:
        rank = min(target.tp_rank, tp - 1)
        for m in rows:
            out.append(_case(f"wq_b TP{tp} {N_HEADS // tp} heads T={m}", PRODUCTION, target, m, N_HEADS, tp, rank,
                             graph=m == max(rows) and tp == tps[0]))
    return out


def _case(name: str, size: str, target: Target, m: int, heads: int, tp: int, rank: int, int32: bool = False,
          graph: bool = False) -> Case:
    return Case(name, size, lambda seed: _inputs(m, heads, tp, rank, int32, seed, target), _ours, _reference,
                _compare, upstream=_upstream, graph=graph)


def _inputs(m: int, heads: int, tp: int, rank: int, int32: bool, seed: int, target: Target) -> Inputs:
    """One call: q_lora [m, k], wq_b of this rank's heads, a rotation table as long as the context (the
    positions span it), and q_out as MQALayer.forward makes it (None at TP1, else the padded q's slice)."""
    import torch

    from v4flash_kernels.qnorm_rope import reference as R

    dev = target.device
    g = torch.Generator(device=dev).manual_seed(seed)
    local = heads // tp
    x = R.make_activation(m, Q_LORA, g, device=dev)
    w, ws = R.make_weight(local * R.HEAD_DIM, Q_LORA, g, device=dev)
    table = target.context if target.is_cuda else 4096
    freqs = R.make_freqs_cis(table, device=dev)
    pos = R.make_positions(m, table, g, device=dev, dtype=torch.int32 if int32 else torch.int64)
    kw: Inputs = {"x": x, "w": w, "ws": ws, "freqs": freqs, "pos": pos, "local": local}
    if tp > 1:
        padded = torch.full((m, heads, R.HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
        kw["q_padded"] = padded
        kw["q_out"] = padded[:, rank * local:(rank + 1) * local, :]
        kw["slice"] = (rank * local, (rank + 1) * local)
    else:
        kw["q_out"] = None
    kw["layer"] = mqa_layer(w, ws, local, freqs, EPS)
    return kw


def mqa_layer(w: Any, ws: Any, heads: int, freqs_cis: Any, eps: float) -> Any:
    """The facts of an `MQALayer` the drop-in reads, as SGLang builds the layer with the `fp8_gemm` patch
    active: wq_b's `Fp8LinearMethod` took our block-FP8 linear from the sm_120 dispatch (128x128 blocks, no
    Marlin / MXFP8), no bias, no output gather; 512-dim heads with a 64-dim RoPE (also the step bench's)."""
    from v4flash_kernels.fp8_gemm.op import w8a8_block_fp8_linear

    quant = SimpleNamespace(w8a8_block_fp8_linear=w8a8_block_fp8_linear, block_quant=True, use_marlin=False,
                            use_mxfp8=False, quant_config=SimpleNamespace(weight_block_size=[128, 128]))
    wq_b = SimpleNamespace(quant_method=quant, weight=w, weight_scale_inv=ws, bias=None, gather_output=False)
    return SimpleNamespace(wq_b=wq_b, head_dim=512, qk_rope_head_dim=64, n_local_heads=heads, eps=eps,
                           freqs_cis=freqs_cis)


def _ours(kw: Inputs) -> Any:
    return registry_function(PATCH)(kw["layer"], kw["x"], kw["pos"], kw["q_out"])


def _upstream(kw: Inputs) -> Any:
    from v4flash_kernels.qnorm_rope.upstream import unfused

    return unfused(kw["x"], kw["w"], kw["ws"], kw["local"], EPS, kw["freqs"], kw["pos"], kw["q_out"])


def _reference(kw: Inputs) -> Tuple[Any, Any]:
    from v4flash_kernels.qnorm_rope import reference as R

    # the interpreter truncates its bf16 casts and accumulates in IEEE fp32
    gpu = kw["x"].is_cuda
    args = (kw["x"], kw["w"], kw["ws"], kw["local"], EPS, kw["freqs"], kw["pos"])
    return R.qnorm_rope_ref(*args), R.error_bound(*args, bf16_unit=R.BF16_RN if gpu else R.BF16_TRUNC,
                                                  acc=R.ACC if gpu else R.ACC_IEEE)


def _compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    import torch

    from v4flash_kernels.kit.compare import rel_err
    from v4flash_kernels.qnorm_rope.reference import excess

    want, bound = ref
    m, local = kw["x"].shape[0], kw["local"]
    if not torch.is_tensor(out) or tuple(out.shape) != (m, local, 512) or out.dtype != torch.bfloat16:
        return Comparison(False, {}, f"returned {getattr(out, 'shape', out)!r}, not a bf16 [{m}, {local}, 512]")
    if kw["q_out"] is not None and out.data_ptr() != kw["q_out"].data_ptr():
        return Comparison(False, {}, "did not return the q_out it was given")
    metrics = {"excess": round(excess(out, want.to(out.device), bound.to(out.device)), 4),
               "rel_err": rel_err(out, want.to(out.device))}
    problems = []
    if "q_padded" in kw:
        lo, hi = kw["slice"]
        others = torch.cat([kw["q_padded"][:, :lo], kw["q_padded"][:, hi:]], dim=1)
        touched = int((~torch.isnan(others.float())).sum())
        metrics["other_heads_written"] = touched
        if touched:
            problems.append(f"{touched} values written outside this rank's heads")
    if not metrics["excess"] <= 1.0:
        problems.append(f"error {metrics['excess']}x the bound (fp32 accumulation of the fp8 products, bf16 "
                        "at the linear's output, the normalised head and the rotated pair)")
    return Comparison(not problems, metrics, "; ".join(problems))
