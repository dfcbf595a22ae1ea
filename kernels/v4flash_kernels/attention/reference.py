"""Torch reference of the sparse-MLA decode math, plus builders of real-layout random caches.

The reference gathers and dequantizes the attended tokens straight from the fp8_ds_mla bytes
(independently of the kernel's code path) and computes one softmax over the union of both caches
in float64 by default. It follows upstream's conventions: duplicate indices count once per
occurrence, -1 entries and entries at or beyond `topk_length` are ignored, an empty row gives a
zero output and lse -inf, a sink gives `lse = logaddexp(lse, sink)` and scales the output by
`exp(lse_old - lse)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

TOKEN_DATA_BYTES = 576
TOKEN_BYTES = 584
NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = 512


def page_stride(page_size: int) -> int:
    """Bytes per page in SGLang's pool: page padded to a multiple of 576 (256 -> 149760)."""
    return math.ceil(page_size * TOKEN_BYTES / TOKEN_DATA_BYTES) * TOKEN_DATA_BYTES


def dequant_tokens(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dequantize tokens `slots` (any shape, int, >= 0) of a paged cache -> [..., 512] `dtype`."""
    pages, page_size = cache.shape[0], cache.shape[1]
    pb = cache.stride(0)
    flat = cache.as_strided((pages * pb,), (1,)).view(torch.uint8)
    s = slots.to(torch.int64)
    page, off = s // page_size, s % page_size
    data0 = page * pb + off * TOKEN_DATA_BYTES
    scale0 = page * pb + page_size * TOKEN_DATA_BYTES + off * 8
    ar = torch.arange(TOKEN_DATA_BYTES, device=cache.device)
    data = flat[data0.unsqueeze(-1) + ar]  # [..., 576] uint8
    scales = flat[scale0.unsqueeze(-1) + torch.arange(7, device=cache.device)]  # [..., 7]
    nope = data[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).to(dtype)
    mult = torch.pow(2.0, scales.to(dtype) - 127.0)
    nope = (nope.unflatten(-1, (7, 64)) * mult.unsqueeze(-1)).flatten(-2)
    rope = data[..., NOPE_DIM:].contiguous().view(torch.bfloat16).to(dtype)
    return torch.cat([nope, rope], dim=-1)


def _gather(cache: Any, indices: Any, length: Any, batch: Any, dtype: torch.dtype) -> Any:
    idx = indices.reshape(batch, -1).to(torch.int64)
    w = idx.shape[1]
    valid = idx >= 0
    if length is not None:
        valid &= torch.arange(w, device=idx.device)[None, :] < length.reshape(-1, 1).to(torch.int64)
    kv = dequant_tokens(cache, idx.clamp(min=0), dtype)
    kv = torch.where(valid.unsqueeze(-1), kv, torch.zeros((), dtype=dtype, device=kv.device))
    return kv, valid


def sparse_mla_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    head_dim_v: int,
    softmax_scale: float | None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference decode; returns (out [B,1,H,512], lse [B,H,1]) in `dtype`."""
    B, _, H, D = q.shape
    if softmax_scale is None:
        softmax_scale = D ** (-0.5)
    kv, valid = _gather(k_cache, indices, topk_length, B, dtype)
    if extra_k_cache is not None and extra_indices is not None:
        kv2, valid2 = _gather(extra_k_cache, extra_indices, extra_topk_length, B, dtype)
        kv = torch.cat([kv, kv2], dim=1)
        valid = torch.cat([valid, valid2], dim=1)
    qd = q[:, 0].to(dtype)  # [B, H, 512]
    scores = torch.einsum("bhd,btd->bht", qd, kv) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]; -inf for empty rows
    empty = torch.isinf(lse) & (lse < 0)
    p = torch.exp(scores - torch.where(empty, 0.0, lse).unsqueeze(-1))
    p = torch.where(empty.unsqueeze(-1), 0.0, p)
    out = torch.einsum("bht,btd->bhd", p, kv)
    if attn_sink is not None:
        sink = attn_sink.to(dtype).reshape(1, H)
        lse_f = torch.logaddexp(lse, sink.expand_as(lse))
        out = out * torch.where(empty, 0.0, torch.exp(lse - lse_f)).unsqueeze(-1)
        lse = lse_f
    return out.unsqueeze(1), lse.unsqueeze(-1)




# ---------------------------------------------------------------- random real-layout inputs


@dataclass(frozen=True)
class CacheSpec:
    num_pages: int
    page_size: int
    fp8_view: bool = False  # hand the kernel a float8_e4m3fn view instead of uint8


def make_cache(spec: CacheSpec, device: str | torch.device = "cpu", gen: torch.Generator | None = None) -> torch.Tensor:
    """Random fp8_ds_mla pool `[P, page_stride]` uint8, returned as SGLang's `[P, ps, 1, 584]` view.

    Every byte starts as garbage (including fp8 NaN patterns in page padding and the scale pad
    byte), then each slot gets sane fp8 NoPE values, ue8m0 scales near 2^0 and bf16 RoPE.
    """
    P, ps = spec.num_pages, spec.page_size
    pb = page_stride(ps)
    g = gen
    pool = torch.randint(0, 256, (P, pb), dtype=torch.uint8, generator=g)
    nope = (torch.randn((P, ps, NOPE_DIM), generator=g) * 2.0).to(torch.float8_e4m3fn)
    rope = (torch.randn((P, ps, ROPE_DIM), generator=g)).to(torch.bfloat16)
    scales = torch.randint(123, 131, (P, ps, 7), dtype=torch.uint8, generator=g)
    data = torch.cat([nope.view(torch.uint8), rope.view(torch.uint8)], dim=-1)  # [P, ps, 576]
    pool[:, : ps * TOKEN_DATA_BYTES] = data.reshape(P, ps * TOKEN_DATA_BYTES)
    sc = pool[:, ps * TOKEN_DATA_BYTES : ps * TOKEN_BYTES].view(P, ps, 8)
    sc[:, :, :7] = scales
    pool = pool.to(device)
    view = pool[:, : ps * TOKEN_BYTES].view(P, ps, 1, TOKEN_BYTES)
    if spec.fp8_view:
        view = view.view(torch.float8_e4m3fn)
    return view


def make_indices(
    batch: int,
    width: int,
    lengths: torch.Tensor,
    slots_per_row: int,
    dense: bool,
    hole_frac: float = 0.0,
    dup_frac: float = 0.0,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """Indices `[B, 1, width]` int32; row b draws from its own slot range [b*spr, (b+1)*spr).

    `dense` = in-order recent slots (SWA window, c128); else a random subset (c4 top-k). Entries at or
    beyond `lengths[b]` are -1 padding like SGLang's; `hole_frac` adds -1 holes inside the valid
    part and `dup_frac` repeats earlier entries (the kernel must count both occurrences).
    """
    out = torch.full((batch, width), -1, dtype=torch.int32)
    for b in range(batch):
        n = int(lengths[b])
        if n <= 0:
            continue
        if dense:
            first = max(0, slots_per_row - n)
            row = torch.arange(first, first + n)
        else:
            row = torch.randperm(slots_per_row, generator=gen)[:n].sort().values
        row = row + b * slots_per_row
        if dup_frac > 0 and n > 1:
            k = max(1, int(n * dup_frac))
            pos = torch.randint(1, n, (k,), generator=gen)
            src = torch.randint(0, n, (k,), generator=gen)
            row[pos] = row[src]
        if hole_frac > 0:
            holes = torch.rand(n, generator=gen) < hole_frac
            row = torch.where(holes, torch.full_like(row, -1), row)
        out[b, :n] = row.to(torch.int32)
    return out.view(batch, 1, width)


@dataclass(frozen=True)
class Case:
    """One decode call's shapes: main (SWA) cache and an optional extra cache."""

    batch: int
    heads: int
    width: int = 128
    page_size: int = 256
    extra_width: int = 0  # 0 = SWA-only layer
    extra_page_size: int = 64
    extra_dense: bool = False
    sink: bool = True
    fp8_view: bool = False
    hole_frac: float = 0.02
    dup_frac: float = 0.0
    short_rows: bool = True  # some rows shorter than the width, one empty when B > 2
    ctx_tokens: int = 0  # extra-cache valid length target (0 = full width)


def make_inputs(case: Case, device: str | torch.device = "cpu", seed: int | None = None) -> Dict[str, Any]:
    """Keyword arguments for `sparse_mla_decode` (and the reference) drawn fresh for `case`."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    B, H = case.batch, case.heads

    def lengths(width: int, full: int) -> torch.Tensor:
        ln = torch.full((B,), min(full, width), dtype=torch.int32)
        if case.short_rows and B > 1:
            ln[1::3] = torch.randint(1, max(2, min(full, width)), (len(ln[1::3]),), generator=g).to(torch.int32)
            if B > 2:
                ln[2] = 0
        return ln

    def cache_for(width: int, page_size: int, spr: int) -> Any:
        pages = max(1, math.ceil(B * spr / page_size))
        return make_cache(CacheSpec(pages, page_size, case.fp8_view), device, g)

    spr_a = max(case.width, case.page_size)
    len_a = lengths(case.width, case.width)
    kw = {
        "q": (torch.randn((B, 1, H, HEAD_DIM), generator=g)).to(torch.bfloat16).to(device),
        "k_cache": cache_for(case.width, case.page_size, spr_a),
        "indices": make_indices(B, case.width, len_a, spr_a, True, case.hole_frac, case.dup_frac, g).to(device),
        "topk_length": len_a.to(device),
        "attn_sink": (torch.randn((H,), generator=g) * 2.0).to(device) if case.sink else None,
        "head_dim_v": HEAD_DIM,
        "softmax_scale": HEAD_DIM**-0.5,
    }
    if case.extra_width:
        full = case.ctx_tokens or case.extra_width
        spr_b = max(case.extra_width, full) if case.extra_dense else max(4 * case.extra_width, 64)
        len_b = lengths(case.extra_width, full)
        kw.update(
            extra_k_cache=cache_for(case.extra_width, case.extra_page_size, spr_b),
            extra_indices=make_indices(
                B, case.extra_width, len_b, spr_b, case.extra_dense, case.hole_frac, case.dup_frac, g
            ).to(device),
            extra_topk_length=len_b.to(device),
        )
    return kw


def valid_tokens(kw: Dict[str, Any]) -> int:
    """Tokens actually attended (for the bytes floor)."""
    total = 0
    for idx, ln in (("indices", "topk_length"), ("extra_indices", "extra_topk_length")):
        if kw.get(idx) is None:
            continue
        i = kw[idx].reshape(kw[idx].shape[0], -1)
        v = i >= 0
        if kw.get(ln) is not None:
            v &= torch.arange(i.shape[1], device=i.device)[None, :] < kw[ln].reshape(-1, 1)
        total += int(v.sum())
    return total
