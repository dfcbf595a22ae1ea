"""Self-check cases of the top-512 patch (`topk`): see v4flash_kernels.selfcheck.

Production shapes are one c4 layer's call as SGLang makes it: decode at each batch size with scores
as wide as the configured context (`--context-length` / 4 positions, the page table / 256 columns)
and rows of every length up to the whole context plus a CUDA-graph padding row (length 1); on
prefill GPUs one extend chunk (row t has (t+1)//4 positions). The largest decode batch is also
captured in a CUDA graph and replayed. The result is (page indices, raw positions); it is compared
with the exact reference as per-row sets (upstream's order is unspecified), every slot written.
"Upstream" here is the wheel's torch re-statement of the op (`topk_transform_512_pytorch_vectorized`,
what SGLANG_TOPK_TRANSFORM_512_TORCH runs): the JIT kernel itself needs SGLang's CUDA JIT.
"""

from __future__ import annotations

from typing import Any, Dict, List

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, check_rows, registry_function

PATCH = "topk"
K = 512
PAGE = 64  # c4 positions per page (256 tokens)
POISON = -7


def cases(target: Target) -> List[Case]:
    out = [
        _case("small B=5 mixed lengths", SMALL, target, lambda seed: _small_inputs(seed, target.device)),
    ]
    if target.small_only:
        return out
    width = max(1, target.context // 4)
    largest = max(target.decode_rows)
    for b in target.decode_rows:
        out.append(_case(f"decode B={b} context {target.context}", PRODUCTION, target,
                         lambda seed, b=b: decode_inputs(b, width, seed, target.device), graph=b == largest))
    if target.prefill_rows:
        t = target.prefill_rows
        out.append(_case(f"prefill T={t}", PRODUCTION, target, lambda seed: prefill_inputs(t, seed, target.device)))
    return out


def _case(name: str, size: str, target: Target, make: Any, graph: bool = False) -> Case:
    return Case(name, size, lambda seed: _meta(make(seed)), _ours, _reference, _compare, upstream=_upstream,
                graph=graph)


def _inputs(scores: Any, lens: Any, table: Any) -> Inputs:
    import torch

    B = scores.shape[0]
    return {"scores": scores, "seq_lens": lens.to(torch.int32), "page_table": table,
            "out_pages": torch.empty((B, K), dtype=torch.int32, device=scores.device),
            "out_raw": torch.empty((B, K), dtype=torch.int32, device=scores.device)}


def _small_inputs(seed: int, device: str) -> Inputs:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn((5, 3000), generator=g, device=device)
    lens = torch.tensor([3000, 2048, 513, 300, 1], device=device)
    table = torch.randint(0, 1 << 16, (5, 47), generator=g, device=device, dtype=torch.int32)
    return _inputs(scores, lens, table)


def decode_inputs(batch: int, width: int, seed: int, device: str) -> Inputs:
    """Row 0 spans the whole configured context, the others random lengths, the last row of a batch
    > 2 is CUDA-graph padding (length 1); past a row's length the scores are -inf, as the indexer
    writes them."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn((batch, width), generator=g, device=device)
    lens = torch.randint(1, width + 1, (batch,), generator=g, device=device)
    lens[0] = width
    if batch > 2:
        lens[-1] = 1
    scores.masked_fill_(torch.arange(width, device=device)[None, :] >= lens[:, None], float("-inf"))
    cols = -(-width // PAGE)
    table = torch.randint(1, 1 << 20, (batch, cols), generator=g, device=device, dtype=torch.int32)
    return _inputs(scores, lens, table)


def prefill_inputs(rows: int, seed: int, device: str) -> Inputs:
    """One extend chunk of one request: every row shares the request's table; row t has (t+1)//4 positions."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    cols = -(-rows // 256)
    width = cols * PAGE
    scores = torch.randn((rows, width), generator=g, device=device)
    lens = (torch.arange(rows, device=device) + 1) // 4
    scores.masked_fill_(torch.arange(width, device=device)[None, :] >= lens[:, None], float("-inf"))
    table = torch.randint(1, 1 << 20, (1, cols), generator=g, device=device, dtype=torch.int32).expand(rows, cols)
    return _inputs(scores, lens, table.contiguous())


def _meta(kw: Inputs) -> Inputs:
    kw["_rows"] = check_rows(kw["scores"].shape[0], 16)
    return kw


def _call(fn: Any, kw: Inputs) -> Any:
    kw["out_pages"].fill_(POISON)
    kw["out_raw"].fill_(POISON)
    fn(kw["scores"], kw["seq_lens"], kw["page_table"], kw["out_pages"], PAGE, kw["out_raw"])
    return kw["out_pages"], kw["out_raw"]


def _ours(kw: Inputs) -> Any:
    return _call(registry_function(PATCH), kw)


_UPSTREAM: Dict[str, Any] = {}


def _upstream(kw: Inputs) -> Any:
    if "mod" not in _UPSTREAM:
        from v4flash_kernels.upstream import load_indexer

        _UPSTREAM["mod"] = load_indexer()
    return _call(_UPSTREAM["mod"].topk_transform_512_pytorch_vectorized, kw)


def _reference(kw: Inputs) -> Any:
    from v4flash_kernels.topk.reference import topk_transform_ref

    r = kw["_rows"]
    return topk_transform_ref(kw["scores"][r], kw["seq_lens"][r], kw["page_table"][r], K, PAGE)


def _compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    import torch

    pages, raw = out
    want = (kw["scores"].shape[0], K)
    if tuple(pages.shape) != want or tuple(raw.shape) != want or pages.dtype != torch.int32:
        return Comparison(False, {}, f"outputs are {tuple(pages.shape)} / {tuple(raw.shape)} {pages.dtype}, "
                                     f"expected {want} torch.int32")
    r = kw["_rows"]
    got_p, got_r = pages[r].cpu(), raw[r].cpu()
    want_p, want_r = ref
    unwritten = int((pages == POISON).sum()) + int((raw == POISON).sum())
    bad = [int(row) for i, row in enumerate(r)
           if not (torch.equal(torch.sort(got_r[i]).values, torch.sort(want_r[i]).values)
                   and torch.equal(torch.sort(got_p[i]).values, torch.sort(want_p[i]).values))]
    same_order = sum(1 for i in range(len(r)) if torch.equal(got_r[i], want_r[i]))
    problems = []
    if unwritten:
        problems.append(f"{unwritten} output slots not written")
    if bad:
        problems.append(f"rows {bad[:6]} select other positions or pages than the reference")
    return Comparison(not problems, {"rows_checked": len(r), "rows_in_reference_order": same_order,
                                     "unwritten": unwritten}, "; ".join(problems))
