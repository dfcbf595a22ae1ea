"""Self-check cases of the sparse-MLA decode patch (`sparse_decode`): see v4flash_kernels.selfcheck.

Ours is called as the hook installs it: `tp_heads.make_tp_aware` around the registry's function,
with this GPU's attention-TP rank, on a 64-head q whose other heads hold NaN/Inf like SGLang's
padding, so exactly the heads this GPU computes in production are checked. Production shapes are
the three layer kinds (SWA only; + c4 top-512; + c128 over the configured context) at each decode
batch size, and at one prefill chunk's rows on prefill GPUs (the extend path runs this kernel with
one row per token); the c4 decode calls are also captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, check_rows, registry_function

PATCH = "sparse_decode"
HEADS = 64  # DeepSeek-V4-Flash's q heads before attention-TP slicing
WINDOW = 128  # SWA top-k width
C4_WIDTH = 512
REL_TOL = 1e-2  # relative Frobenius error of out vs fp64 (bf16 output)
LSE_TOL = 1e-2
_POISON = (float("nan"), float("inf"), float("-inf"), 3.0e38)


def cases(target: Target) -> List[Case]:
    heads = _heads(target)
    out = [
        _small("small c4 B=3", heads, target, {"batch": 3, "width": 64, "page_size": 64, "extra_width": 64,
                                                "extra_page_size": 64}),
        _small("small c128 B=2", heads, target, {"batch": 2, "width": 64, "page_size": 64, "extra_width": 128,
                                                        "extra_page_size": 2, "extra_dense": True}),
    ]
    if target.small_only:
        return out
    kinds = (("swa", 0), ("c4", C4_WIDTH), ("c128", math.ceil(target.context / 128)))
    for b in target.decode_rows:
        for kind, extra in kinds:
            out.append(_production(f"decode {kind} B={b}", kind, b, extra, heads, target,
                                   graph=kind == "c4", upstream=b == 1))
    if target.prefill_rows:
        t = target.prefill_rows
        for kind, extra in (("swa", 0), ("c4", C4_WIDTH), ("c128", math.ceil(t / 128))):
            out.append(_production(f"prefill {kind} T={t}", kind, t, extra, heads, target, graph=False, upstream=False))
    return out


def _heads(target: Target) -> Tuple[int, int]:
    from v4flash_kernels.hook.tp_heads import AttnTp, heads_for

    return heads_for(HEADS, AttnTp(target.tp_rank, target.tp_size)) or (0, HEADS)


def _installed(target: Target) -> Callable[..., Any]:
    """The function the hook installs on this GPU: the adapter, told this GPU's rank."""
    from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware

    tp = AttnTp(target.tp_rank, target.tp_size)
    return make_tp_aware(registry_function(PATCH), read=lambda: tp)


_ARGS = ("q", "k_cache", "indices", "topk_length", "attn_sink", "head_dim_v", "softmax_scale",
         "extra_k_cache", "extra_indices", "extra_topk_length")


def _call(fn: Callable[..., Any]) -> Callable[[Inputs], Any]:
    return lambda kw: fn(*(kw.get(a) for a in _ARGS))


_UPSTREAM: Dict[str, Any] = {}


def _upstream(kw: Inputs) -> Any:
    if "mod" not in _UPSTREAM:
        from v4flash_kernels.upstream import load_upstream

        _UPSTREAM["mod"] = load_upstream()
    return _call(_UPSTREAM["mod"].flash_mla_sparse_decode_triton)(kw)


def _poison(q: Any, heads: Tuple[int, int]) -> None:
    """The heads this GPU does not own hold what SGLang's uninitialised padding may: NaN, Inf, huge."""
    for h in range(q.shape[2]):
        if not heads[0] <= h < heads[1]:
            q[:, :, h] = _POISON[h % len(_POISON)]


def _small(name: str, heads: Tuple[int, int], target: Target, shape: Dict[str, Any]) -> Case:
    from v4flash_kernels.attention.reference import Case as Shape
    from v4flash_kernels.attention.reference import make_inputs

    def inputs(seed: int) -> Inputs:
        kw = make_inputs(Shape(heads=HEADS, hole_frac=0.05, **shape), device=target.device, seed=seed)
        _poison(kw["q"], heads)
        return _meta(kw, heads, target)

    return Case(name, SMALL, inputs, _call(_installed(target)), _reference, _compare,
                upstream=_upstream if target.is_cuda else None,
                upstream_skip="" if target.is_cuda else "upstream's autotuned Triton kernel needs a GPU to pick its config")


def _production(name: str, kind: str, batch: int, extra_width: int, heads: Tuple[int, int], target: Target,
                graph: bool, upstream: bool) -> Case:
    def inputs(seed: int) -> Inputs:
        return _meta(production_inputs(kind, batch, extra_width, heads, seed, target.device), heads, target)

    return Case(name, PRODUCTION, inputs, _call(_installed(target)), _reference, _compare,
                upstream=_upstream if upstream else None,
                upstream_skip="" if upstream else "upstream computes all 64 heads one program per (row, head): "
                                                  "only timed at B=1", graph=graph)


def _meta(kw: Inputs, heads: Tuple[int, int], target: Target) -> Inputs:
    import torch

    kw["_rows"] = torch.tensor(check_rows(kw["q"].shape[0], 16), device=target.device)
    kw["_heads"] = heads
    return kw


def production_inputs(kind: str, batch: int, extra_width: int, heads: Tuple[int, int], seed: int,
                      device: str) -> Inputs:
    """A production call's arguments, drawn on `device`: real fp8_ds_mla pools of bounded size (rows
    share them: an 8K-row prefill chunk must not need 8K rows' worth of pages), rows of every length
    (full, short, one empty), -1 holes, this GPU's heads real and the others poisoned."""
    import torch

    from v4flash_kernels.attention.reference import HEAD_DIM, CacheSpec, make_cache

    g = torch.Generator(device=device).manual_seed(seed)
    gc = torch.Generator().manual_seed(seed)
    q = torch.randn((batch, 1, HEADS, HEAD_DIM), generator=g, device=device).to(torch.bfloat16)
    _poison(q, heads)
    main_pages = 16  # 4096 slots of the 256-token SWA pages
    kw: Dict[str, Any] = {
        "q": q, "k_cache": make_cache(CacheSpec(main_pages, 256), device, gc),
        "attn_sink": torch.randn((HEADS,), generator=g, device=device) * 2.0,
        "head_dim_v": HEAD_DIM, "softmax_scale": HEAD_DIM ** -0.5,
    }
    len_a = _lengths(batch, WINDOW, g, device)
    kw.update(indices=_indices(batch, WINDOW, main_pages * 256, True, len_a, g, device), topk_length=len_a)
    if extra_width:
        dense = kind == "c128"
        page = 2 if dense else 64
        slots = max(2 * extra_width, 4096)
        len_b = _lengths(batch, extra_width, g, device)
        kw.update(extra_k_cache=make_cache(CacheSpec(slots // page, page), device, gc),
                  extra_indices=_indices(batch, extra_width, slots, dense, len_b, g, device),
                  extra_topk_length=len_b)
    return kw


def _lengths(batch: int, width: int, g: Any, device: str) -> Any:
    """Full rows, every third row short (1..width-1) and row 2 empty (a padded CUDA-graph row)."""
    import torch

    n = torch.full((batch,), width, dtype=torch.int32, device=device)
    short = torch.randint(1, max(2, width), (batch,), generator=g, device=device, dtype=torch.int32)
    sel = torch.arange(batch, device=device) % 3 == 1
    n = torch.where(sel, short, n)
    if batch > 2:
        n[2] = 0
    return n


def _indices(batch: int, width: int, slots: int, dense: bool, lengths: Any, g: Any, device: str,
             hole: float = 0.01) -> Any:
    import torch

    if dense:
        start = torch.randint(0, slots - width, (batch, 1), generator=g, device=device)
        idx = start + torch.arange(width, device=device)
    else:
        idx = torch.randint(0, slots, (batch, width), generator=g, device=device)
    idx = torch.where(torch.rand((batch, width), generator=g, device=device) < hole, -1, idx)
    past = torch.arange(width, device=device)[None, :] >= lengths[:, None].to(torch.int64)
    return torch.where(past, -1, idx).to(torch.int32).view(batch, 1, width)


def _reference(kw: Inputs) -> Tuple[Any, Any]:
    """fp64 out and lse of the checked rows, for this GPU's heads only."""
    from v4flash_kernels.attention.reference import sparse_mla_decode_ref

    rows, (h0, h1) = kw["_rows"], kw["_heads"]

    def sub(name: str) -> Any | None:
        t = kw.get(name)
        return None if t is None else t[rows]

    sink = kw["attn_sink"]
    return sparse_mla_decode_ref(
        kw["q"][rows][:, :, h0:h1], kw["k_cache"], kw["indices"][rows], sub("topk_length"),
        None if sink is None else sink[h0:h1], kw["head_dim_v"], kw["softmax_scale"],
        kw.get("extra_k_cache"), sub("extra_indices"), sub("extra_topk_length"),
    )


def _compare(out: Any, ref: Tuple[Any, Any], kw: Inputs) -> Comparison:
    import torch

    from v4flash_kernels.kit.compare import rel_err

    o, lse = out
    rows, (h0, h1) = kw["_rows"], kw["_heads"]
    ref_out, ref_lse = ref
    nan = bool(torch.isnan(o[:, :, h0:h1].float()).any() or torch.isnan(lse[:, h0:h1].float()).any())
    o_r = o[rows][:, :, h0:h1].double()
    lse_r = lse[rows][:, h0:h1].reshape(ref_lse.shape).double()
    err = rel_err(o_r, ref_out)
    fin = torch.isfinite(ref_lse)
    lse_err = float((lse_r[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
    inf_ok = bool((lse_r[~fin] == ref_lse[~fin]).all())
    empty = ref_out.abs().amax(dim=(-1, -2, -3)) == 0
    empty_zero = bool((o_r[empty] == 0).all()) if empty.any() else True
    metrics = {"rel_err": err, "lse_abs_err": lse_err, "nan": nan, "lse_inf_ok": inf_ok, "empty_rows_zero": empty_zero,
                   "rows_checked": int(rows.numel()), "heads": [h0, h1]}
    problems = []
    if nan:
        problems.append("NaN in this GPU's heads")
    if not err <= REL_TOL:
        problems.append(f"output rel. error {err:.3g} > {REL_TOL:g}")
    if not lse_err <= LSE_TOL:
        problems.append(f"lse abs. error {lse_err:.3g} > {LSE_TOL:g}")
    if not inf_ok:
        problems.append("lse of a row with no valid token is not the reference's -inf/sink")
    if not empty_zero:
        problems.append("a row with no valid token is not zero")
    return Comparison(not problems, metrics, "; ".join(problems))
