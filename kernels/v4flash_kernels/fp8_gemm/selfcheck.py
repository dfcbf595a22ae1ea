"""Self-check cases of the block-FP8 linear patch (`fp8_gemm`): see v4flash_kernels.selfcheck.

The switch replaces every block-FP8 linear of the model, so the production cases are every such
shape of DeepSeek-V4-Flash at this worker's TP (wqkv_a, wq_b, wo_b, the indexer's wq_b, the shared
expert's gate_up and down; with MTP on also the NextN e_proj / h_proj) at each decode batch, each
speculative verify batch and one prefill chunk: together they launch every plan the op has (the
GEMV, the decode tiles, the split and unsplit large tiles). The largest decode batch of each shape
is also captured in a CUDA graph and replayed on new inputs.

Ours is checked against fp64 on the definition's quantized activation (its quant must be the
definition's bit for bit, so only the GEMM's accumulation and the output rounding remain). Upstream
(sglang's `triton_w8a8_block_fp8_linear` from the wheel) runs on the same inputs and is held to the
same bound against fp64 on *its own* quantized activation (its Triton quant may round a code the
other way at a tie), so the record shows both GEMMs' accumulation error side by side.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Tuple

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, check_rows, registry_function

PATCH = "fp8_gemm"
GROUP = 128


class LinearShape(NamedTuple):
    name: str
    n: int
    k: int


def model_shapes(tp: int, mtp: bool) -> Tuple[LinearShape, ...]:
    """DeepSeek-V4-Flash's block-FP8 linears on one GPU of a TP worker (N x K of the weight)."""
    out = [LinearShape("wqkv_a", 1536, 4096), LinearShape("wq_b", 64 * 512 // tp, 1024),
           LinearShape("wo_b", 4096, 8 * 1024 // tp), LinearShape("indexer_wq_b", 64 * 128, 1024),
           LinearShape("shared_gate_up", 2 * 2048 // tp, 4096), LinearShape("shared_down", 4096, 2048 // tp)]
    if mtp:
        out.append(LinearShape("nextn_proj", 4096, 4096))
    return tuple(out)


# Output rounding of bf16 (2^-8 relative, twice: the GEMM's fp32 result may round the other way
# than fp64's at a tie) plus the fp32 accumulation of fp8 tensor-core products, relative to the sum
# of |terms| (the MMAs add their products with fewer than fp32's bits).
RTOL = 2.0 ** -7
ATOL_MAG = 2.0 ** -10


def cases(target: Target) -> List[Case]:
    out = [_case("small 5 x 384 x 256", SMALL, 5, LinearShape("small", 384, 256), target)]
    if target.small_only:
        return out
    largest = max(target.decode_rows)
    for shape in model_shapes(max(1, target.tp_size), bool(target.verify_rows)):
        for m in target.decode_rows:
            out.append(_case(f"{shape.name} {shape.n}x{shape.k} M={m}", PRODUCTION, m, shape, target,
                             graph=m == largest))
        if target.prefill_rows:
            out.append(_case(f"{shape.name} {shape.n}x{shape.k} prefill M={target.prefill_rows}", PRODUCTION,
                             target.prefill_rows, shape, target))
    return out


def _case(name: str, size: str, m: int, shape: LinearShape, target: Target, graph: bool = False) -> Case:
    up = None if not target.is_cuda else _upstream
    return Case(name, size, lambda seed: _inputs(m, shape, seed, target), _ours, _reference, _compare,
                upstream=up, upstream_skip="" if up else "upstream's Triton GEMM needs a GPU", graph=graph)


def _inputs(m: int, shape: LinearShape, seed: int, target: Target) -> Inputs:
    import torch

    from v4flash_kernels.fp8_gemm.reference import make_activation, make_weight

    g = torch.Generator(device=target.device).manual_seed(seed)
    x = make_activation(m, shape.k, g, device=target.device)
    w, ws = make_weight(shape.n, shape.k, g, device=target.device)
    return {"x": x, "w": w, "ws": ws, "_rows": torch.tensor(check_rows(m), device=target.device)}


def _ours(kw: Inputs) -> Any:
    return registry_function(PATCH)(kw["x"], kw["w"], [GROUP, GROUP], kw["ws"])


class Upstream(NamedTuple):
    """Upstream's output and the activation codes its own quant produced (its fp64 reference's operands)."""

    out: Any
    q: Any
    s: Any


def _upstream(kw: Inputs) -> Any:
    from v4flash_kernels.fp8_gemm.upstream import upstream_fp8_kernel, upstream_fp8_linear

    out = upstream_fp8_linear().triton_w8a8_block_fp8_linear(kw["x"], kw["w"], [GROUP, GROUP], kw["ws"])
    r = kw["_rows"]
    q, s = upstream_fp8_kernel()._per_token_group_quant_8bit_raw(kw["x"][r].contiguous(), GROUP)
    return Upstream(out, q, s)


def _reference(kw: Inputs) -> Any:
    """fp64 of the checked rows on the definition's quantized activation (quant is per row: exact)."""
    from v4flash_kernels.fp8_gemm.reference import linear_ref

    return linear_ref(kw["x"][kw["_rows"]], kw["w"], kw["ws"])


def _compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    from v4flash_kernels.fp8_gemm.reference import matmul_ref
    from v4flash_kernels.kit.compare import excess_error, rel_err

    m, n = kw["x"].shape[0], kw["w"].shape[0]
    r = kw["_rows"]
    if isinstance(out, Upstream):
        want, mag = matmul_ref(out.q, kw["w"], out.s, kw["ws"])
        got, who = out.out, "upstream"
    else:
        (want, mag), got, who = ref, out, "ours"
    if tuple(got.shape) != (m, n) or got.dtype != kw["x"].dtype:
        return Comparison(False, {}, f"{who} returned {tuple(got.shape)} {got.dtype}, not ({m}, {n}) {kw['x'].dtype}")
    rows = got[r]
    ex = excess_error(rows, want, mag, RTOL, ATOL_MAG)
    metrics = {"excess": round(ex, 4), "rel_err": rel_err(rows, want), "rows_checked": int(r.numel())}
    ok = ex <= 1.0
    return Comparison(ok, metrics, "" if ok else f"{who}: error {ex:.3g}x the bound (bf16 rounding 2^-7 relative + "
                                                  f"accumulation 2^-10 of the sum of |terms|)")
