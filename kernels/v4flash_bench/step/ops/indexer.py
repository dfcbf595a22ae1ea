"""Indexer logits of the step: upstream's torch function vs our kernel, checked vs the fp64 logits."""

from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import common as C
from v4flash_bench.step.ops.common import Check, Prepared, Unavailable
from v4flash_kernels import upstream as _up
from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.kit.fp8 import FP8

INDEXER_PATH = "sglang/srt/layers/attention/dsv4/indexer.py"
_INDEXER_PRELUDE = """
import torch
import torch.nn.functional as F
from typing import Any

FP8_DTYPE = torch.float8_e4m3fn
"""


def upstream_indexer() -> Any:
    if "indexer" not in C.loaded:
        C.loaded["indexer"] = _up.load_defs(INDEXER_PATH, ["fp8_paged_mqa_logits_torch_sm120"],
                                           prelude=_INDEXER_PRELUDE)
    return C.loaded["indexer"]


def indexer_inputs(p: Dict[str, object], seed: int) -> Dict[str, Any]:
    """Paged fp8 index-key cache [P, 64, 1, 132] (64x128 fp8 then 64 fp32 scales per page) and a
    page table over the configured context (unused entries 0, as in a fresh req_to_token pool)."""
    rows, conf, actual = C.int_param(p, "rows"), C.int_param(p, "configured_ctx"), C.int_param(p, "actual_ctx")
    prefill = bool(p["prefill"])
    g = C.gen(seed)
    width = conf // M.RAW_PAGE
    used = math.ceil(actual / M.RAW_PAGE)
    n_pages = used if prefill else rows * used
    n_pages += 1  # page 0 stays a valid garbage page for the unused page-table entries
    vals = torch.randn((n_pages, M.INDEX_PAGE, M.INDEX_DIM), generator=g, device=C.DEVICE).to(FP8)
    scales = torch.rand((n_pages, M.INDEX_PAGE), generator=g, device=C.DEVICE) * 0.5 + 0.05
    raw = torch.cat([vals.view(torch.uint8).reshape(n_pages, -1), scales.view(torch.uint8).reshape(n_pages, -1)], 1)
    kv = raw.view(n_pages, M.INDEX_PAGE, 1, M.INDEX_TOKEN_BYTES)
    pt = torch.zeros((rows, width), dtype=torch.int32, device=C.DEVICE)
    ar = torch.arange(used, device=C.DEVICE, dtype=torch.int32)
    if prefill:
        pt[:, :used] = 1 + ar[None, :]
        seq = (torch.arange(rows, device=C.DEVICE, dtype=torch.int32) + 1) // 4
    else:
        pt[:, :used] = 1 + torch.arange(rows, device=C.DEVICE, dtype=torch.int32)[:, None] * used + ar[None, :]
        seq = torch.full((rows,), actual // 4, dtype=torch.int32, device=C.DEVICE)
    q = torch.randn((rows, 1, M.INDEX_HEADS, M.INDEX_DIM), generator=g, device=C.DEVICE).to(FP8)
    w = torch.randn((rows, M.INDEX_HEADS), generator=g, device=C.DEVICE) * 0.1
    # the caller passes c4 seq lens as [rows, 1] (indexer.py: `_c4sl.unsqueeze(-1)`)
    reps = C.int_param(p, "reps", 1)
    if reps > 1:  # verify: a request's k+1 rows read its pages at consecutive lengths (c4 length of L+j)
        pt = pt.repeat_interleave(reps, dim=0).contiguous()
        j = torch.arange(reps, device=C.DEVICE, dtype=torch.int32).repeat(rows)
        seq = ((actual + j) // 4).to(torch.int32).clamp(max=used * M.INDEX_PAGE)
        q = torch.randn((rows * reps, 1, M.INDEX_HEADS, M.INDEX_DIM), generator=g, device=C.DEVICE).to(FP8)
        w = torch.randn((rows * reps, M.INDEX_HEADS), generator=g, device=C.DEVICE) * 0.1
    return {"q_fp8": q, "kvcache_fp8": kv, "weight": w, "seq_lens": seq.clamp(min=1).unsqueeze(-1), "page_table": pt,
                "deep_gemm_metadata": None, "max_seq_len": width * M.INDEX_PAGE, "clean_logits": False}


def indexer_ref(kw: Dict[str, Any], rows: List[int]) -> torch.Tensor:
    """fp64 logits from the format's definition for `rows`: sum_h relu(q_h . k_t) w_h * scale_t."""
    kv = kw["kvcache_fp8"]
    P = kv.shape[0]
    flat = kv.reshape(P, M.INDEX_PAGE * M.INDEX_TOKEN_BYTES)
    vals = flat[:, : M.INDEX_PAGE * M.INDEX_DIM].contiguous().view(FP8).double().view(P, M.INDEX_PAGE, M.INDEX_DIM)
    scl = flat[:, M.INDEX_PAGE * M.INDEX_DIM:].contiguous().view(torch.float32).double().view(P, M.INDEX_PAGE)
    width = kw["max_seq_len"]
    out = torch.full((len(rows), width), float("-inf"), dtype=torch.float64, device=kv.device)
    for i, r in enumerate(rows):
        n = int(kw["seq_lens"][r].reshape(-1)[0])
        pages = kw["page_table"][r, : math.ceil(n / M.INDEX_PAGE)].long()
        k = vals[pages].reshape(-1, M.INDEX_DIM)[:n]
        s = scl[pages].reshape(-1)[:n]
        q = kw["q_fp8"][r, 0].double()  # [H, D]
        logits = (torch.relu(k @ q.t()) * kw["weight"][r].double()[None, :]).sum(1) * s
        out[i, :n] = logits
    return out


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    p = op.p
    kw = indexer_inputs(p, seed)
    if impl == "upstream":
        fn = upstream_indexer().fp8_paged_mqa_logits_torch_sm120
        src = "upstream fp8_paged_mqa_logits_torch_sm120 (wheel): torch over every configured page"
    else:
        fn, why = C.patch_function("indexer")
        if fn is None:
            raise Unavailable(why)
        src = why

    def call() -> Any:
        return fn(kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["seq_lens"], kw["page_table"],
                  kw["deep_gemm_metadata"], kw["max_seq_len"], kw["clean_logits"])

    def check() -> Check:
        out = call()
        C.sync()
        R = kw["q_fp8"].shape[0]
        rows = sorted({0, R // 3, R // 2, R - 1}) if R > 4 else list(range(R))
        if bool(p["prefill"]):
            rows = sorted({0, 7, 100, R // 2, R - 2, R - 1} & set(range(R)))
        ref = indexer_ref(kw, rows)
        got = out[rows].double()
        if tuple(out.shape) != (R, kw["max_seq_len"]):
            return Check(False, float("nan"), f"shape {tuple(out.shape)}")
        fin = torch.isfinite(ref)
        if not torch.equal(torch.isfinite(got), fin):
            return Check(False, float("nan"), "-inf pattern differs from the reference")
        return C.check_of(rel_err(got[fin], ref[fin]), f"rows {rows}")

    return Prepared(lambda: call(), 1, check, src)
