"""The indexer's top-512 of the step: a torch.topk proxy for upstream's JIT kernel vs our drop-in."""

from __future__ import annotations

import math
from typing import Any

import torch

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import common as C
from v4flash_bench.step.ops.common import Check, Prepared, Unavailable
from v4flash_kernels.kit.compare import rel_err


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """Upstream: torch.topk over each row's valid prefix, a stand-in for the JIT radix
    `topk_transform_512` (topk_v1.cuh: one CTA per row over its first seq_len scores, plus the page
    translation), which needs SGLang's CUDA JIT. Ours: the drop-in, called as the indexer calls the
    JIT kernel (scores, c4 seq lens, page table, out page indices, page size 64, out raw indices).
    The rows share one length (decode) or the chunk's longest (prefill, an upper bound)."""
    p = op.p
    rows, width, valid = C.int_param(p, "rows"), C.int_param(p, "width"), C.int_param(p, "valid")
    g = C.gen(seed)
    logits = torch.randn((rows, width), generator=g, device=C.DEVICE)
    logits[:, valid:] = float("-inf")
    head = logits[:, :valid]
    k = min(M.INDEX_TOPK, valid)
    if impl == "upstream":
        def call() -> Any:
            return torch.topk(head, k, dim=1, largest=True, sorted=False)

        def check() -> Check:
            vals, idx = call()
            ref = torch.sort(logits, dim=1, descending=True).values[:, :k]
            got = torch.sort(vals, dim=1, descending=True).values
            ok = torch.equal(torch.gather(logits, 1, idx), vals) and bool(torch.isfinite(got).all())
            return C.check_of(rel_err(got, ref) if ok else float("nan"))

        return Prepared(lambda: call(), 1, check, "proxy: torch.topk over the valid prefix (JIT topk_transform_512 "
                        "needs SGLang's CUDA JIT)")
    fn, why = C.patch_function("topk")
    if fn is None:
        raise Unavailable(why)
    pages = math.ceil(width / M.INDEX_PAGE)
    table = torch.randperm(rows * pages, generator=g, device=C.DEVICE).to(torch.int32).view(rows, pages)
    seq = torch.full((rows,), valid, dtype=torch.int32, device=C.DEVICE)
    out_pages = torch.empty((rows, M.INDEX_TOPK), dtype=torch.int32, device=C.DEVICE)
    out_raw = torch.empty((rows, M.INDEX_TOPK), dtype=torch.int32, device=C.DEVICE)

    def call2() -> None:
        fn(logits, seq, table, out_pages, M.INDEX_PAGE, out_raw)

    def check2() -> Check:
        out_pages.fill_(-7)
        out_raw.fill_(-7)
        call2()
        C.sync()
        raw = out_raw[:, :k].long()
        if bool((raw < 0).any()) or bool((raw >= valid).any()):
            return Check(False, float("nan"), "raw index outside the row's valid prefix")
        got = torch.sort(torch.gather(logits, 1, raw), dim=1, descending=True).values
        ref = torch.sort(logits, dim=1, descending=True).values[:, :k]
        want_pages = torch.gather(table.long(), 1, raw // M.INDEX_PAGE) * M.INDEX_PAGE + raw % M.INDEX_PAGE
        if not torch.equal(out_pages[:, :k].long(), want_pages):
            return Check(False, float("nan"), "page translation differs")
        if k < M.INDEX_TOPK and not bool((out_pages[:, k:] == -1).all()):
            return Check(False, float("nan"), "slots past the row's length are not -1")
        return C.check_of(rel_err(got, ref))

    return Prepared(call2, 1, check2, why)
