"""Sparse-MLA attention rows of the step: upstream's Triton wrapper vs our drop-in (through the TP-heads
adapter), checked vs the fp64 reference on real-layout caches."""

from __future__ import annotations

import math
from typing import Any, Dict

import torch
import torch.nn.functional as F

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import common as C
from v4flash_bench.step.ops.common import Check, Prepared, Unavailable
from v4flash_kernels import upstream as _up
from v4flash_kernels.kit.compare import rel_err


def upstream_attention() -> Any:
    return _up.load_upstream()


def decode_attention_inputs(p: Dict[str, object], seed: int) -> Dict[str, Any]:
    from v4flash_kernels.attention.reference import Case, make_inputs

    kind, rows, heads = str(p["kind"]), C.int_param(p, "rows"), M.N_HEADS  # q always holds all 64 heads at TP4
    if kind == "window":
        case = Case(batch=rows, heads=heads, hole_frac=0.01)
    elif kind == "c4":
        case = Case(batch=rows, heads=heads, hole_frac=0.01, extra_width=C.int_param(p, "width_extra"), extra_page_size=64,
                    extra_dense=False, ctx_tokens=C.int_param(p, "valid_extra"))
    else:
        case = Case(batch=rows, heads=heads, hole_frac=0.01, extra_width=C.int_param(p, "width_extra"), extra_page_size=2,
                    extra_dense=True, ctx_tokens=C.int_param(p, "valid_extra"))
    return expand_rows(make_inputs(case, device=C.DEVICE, seed=seed), C.int_param(p, "reps", 1), seed)


def expand_rows(kw: Dict[str, Any], reps: int, seed: int) -> Dict[str, Any]:
    """A verify step: each request's row repeated `reps` times (its k+1 draft positions) with fresh q,
    the same indices (one cache, read by all its rows) and consecutive lengths where the index width
    leaves room (a row's window and compressed tokens grow by one position per draft token)."""
    if reps == 1:
        return kw
    out = dict(kw)
    g = C.gen(seed + 7)
    step = torch.arange(reps, device=C.DEVICE, dtype=torch.int32).repeat(kw["q"].shape[0])
    out["q"] = C.randn((kw["q"].shape[0] * reps, *kw["q"].shape[1:]), g)
    for key in ("indices", "extra_indices"):
        if kw.get(key) is not None:
            out[key] = kw[key].repeat_interleave(reps, dim=0).contiguous()
    for key, idx in (("topk_length", "indices"), ("extra_topk_length", "extra_indices")):
        if kw.get(key) is not None:
            base = kw[key].repeat_interleave(reps)
            width = kw[idx].shape[-1]
            grown = torch.minimum(base + step, torch.full_like(base, width))
            # a grown slot must hold a real token: keep the base length where the next index is -1
            nxt = torch.gather(out[idx].view(out[idx].shape[0], -1), 1,
                               (grown - 1).clamp(min=0).long().view(-1, 1)).view(-1)
            out[key] = torch.where((grown > base) & (nxt < 0), base, grown).to(torch.int32).contiguous()
    return out


def prefill_attention_inputs(p: Dict[str, object], seed: int) -> Dict[str, Any]:
    """One request's chunk of T tokens (positions 0..T-1), one row per token, shared caches.

    Row t: window = tokens max(0, t-127)..t; c4 = a random 512-subset of its (t+1)//4 compressed
    tokens (all of them when fewer); c128 = all (t+1)//128 compressed tokens, length clamped to 1
    like `c128_topk_lengths_clamp1` (an index of -1 marks the empty slot).
    """
    from v4flash_kernels.attention.reference import HEAD_DIM, CacheSpec, make_cache

    kind, T, heads = str(p["kind"]), C.int_param(p, "rows"), M.N_HEADS
    g = torch.Generator().manual_seed(seed)
    gc = C.gen(seed)
    dev = C.DEVICE
    t = torch.arange(T, device=dev)
    win_pos = t[:, None] - (M.WINDOW - 1) + torch.arange(M.WINDOW, device=dev)[None, :]
    win_len = torch.clamp(t + 1, max=M.WINDOW)
    # left-align: row t holds its min(t+1,128) tokens first, then -1
    shift = M.WINDOW - win_len
    col = torch.arange(M.WINDOW, device=dev)[None, :] + shift[:, None]
    win_idx = torch.where(col < M.WINDOW, torch.gather(win_pos, 1, col.clamp(max=M.WINDOW - 1)), -1)
    kw = {
        "q": C.randn((T, 1, heads, HEAD_DIM), gc),
        "k_cache": make_cache(CacheSpec(math.ceil(T / 256), 256), dev, g),
        "indices": win_idx.to(torch.int32).view(T, 1, M.WINDOW).contiguous(),
        "topk_length": win_len.to(torch.int32),
        "attn_sink": (torch.randn((heads,), generator=gc, device=dev) * 2.0),
        "head_dim_v": HEAD_DIM,
        "softmax_scale": HEAD_DIM ** -0.5,
    }
    if kind == "c4":
        n_c = max(1, T // 4)
        valid = (t + 1) // 4
        score = torch.rand((T, n_c), generator=gc, device=dev)
        score = torch.where(torch.arange(n_c, device=dev)[None, :] < valid[:, None], score, -1.0)
        k = min(M.INDEX_TOPK, n_c)
        val, idx = score.topk(k, dim=1)
        idx = torch.where(val >= 0, idx, -1).to(torch.int32)
        if k < M.INDEX_TOPK:
            idx = F.pad(idx, (0, M.INDEX_TOPK - k), value=-1)
        kw.update(extra_k_cache=make_cache(CacheSpec(math.ceil(n_c / 64), 64), dev, g),
                  extra_indices=idx.view(T, 1, M.INDEX_TOPK).contiguous(),
                  extra_topk_length=torch.clamp(valid, max=M.INDEX_TOPK).to(torch.int32))
    elif kind == "c128":
        n_c = max(1, T // 128)
        valid = (t + 1) // 128
        ar = torch.arange(n_c, device=dev)[None, :]
        idx = torch.where(ar < valid[:, None], ar, -1).to(torch.int32)
        kw.update(extra_k_cache=make_cache(CacheSpec(math.ceil(n_c / 2), 2), dev, g),
                  extra_indices=idx.view(T, 1, n_c).contiguous(),
                  extra_topk_length=torch.clamp(valid, min=1).to(torch.int32))
    return kw


def _rows_of(kw: Dict[str, Any], rows: torch.Tensor, heads: int) -> Dict[str, Any]:
    out = dict(kw)
    for key in ("q", "indices", "topk_length", "extra_indices", "extra_topk_length"):
        if kw.get(key) is not None:
            out[key] = kw[key][rows]
    out["q"] = out["q"][:, :, :heads]
    out["attn_sink"] = kw["attn_sink"][:heads]
    return out


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    from v4flash_kernels.attention.reference import sparse_mla_decode_ref

    p = op.p
    prefill = bool(p["prefill"])
    heads = C.int_param(p, "heads")  # heads computed; q holds all 64 (SGLang pads q at TP4)
    kw = prefill_attention_inputs(p, seed) if prefill else decode_attention_inputs(p, seed)
    if impl == "upstream":
        up = upstream_attention()
        src = "upstream flash_mla_sparse_decode_triton (wheel), all 64 heads (q padded at TP4)"

        def call() -> Any:
            return up.flash_mla_sparse_decode_triton(
                q=kw["q"], k_cache=kw["k_cache"], indices=kw["indices"], topk_length=kw["topk_length"],
                attn_sink=kw["attn_sink"], head_dim_v=kw["head_dim_v"], softmax_scale=kw["softmax_scale"],
                extra_k_cache=kw.get("extra_k_cache"), extra_indices=kw.get("extra_indices"),
                extra_topk_length=kw.get("extra_topk_length"))
    else:
        fn, why = C.patch_function("sparse_decode")
        if fn is None:
            raise Unavailable(why)
        src = f"{why}, all {heads} heads"
        if heads < M.N_HEADS:  # the registry's TP adapter: rank 0 of TP computes heads 0..64/TP-1
            from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware

            fn = make_tp_aware(fn, read=lambda: AttnTp(0, M.N_HEADS // heads))
            src = f"{why} via tp_heads adapter: {heads} of {M.N_HEADS} heads (rank 0 of {M.N_HEADS // heads})"

        def call() -> Any:
            return fn(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"], kw["head_dim_v"],
                      kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices"),
                      kw.get("extra_topk_length"))

    def check() -> Check:
        out, lse = call()
        C.sync()
        B = kw["q"].shape[0]
        rows = torch.arange(B, device=C.DEVICE)
        if B > 64:  # prefill: check 64 rows spread over the chunk (first, last and between)
            rows = torch.linspace(0, B - 1, 64, device=C.DEVICE).round().long()
        sub = _rows_of(kw, rows, heads)
        ref_out, ref_lse = sparse_mla_decode_ref(**sub)
        err = rel_err(out[rows][:, :, :heads], ref_out)
        fin = torch.isfinite(ref_lse)
        lse_d = lse[rows][:, :heads].reshape(ref_lse.shape).double()
        lse_err = float((lse_d[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
        ok = err == err and err <= C.REL_TOL and lse_err <= 1e-2
        return Check(ok, err, f"lse abs err {lse_err:.1e}, {len(rows)} rows x {heads} heads checked")

    return Prepared(lambda: call(), 1, check, src)
