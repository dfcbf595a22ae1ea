"""Self-check cases of the indexer-logits patch (`indexer`): see v4flash_kernels.selfcheck.

Production shapes are one c4 layer's call as SGLang makes it: decode at each batch size with the
page table as wide as the configured context (`--context-length` / 256 columns, `max_seq_len` =
64 per column) and rows of every length up to the whole context plus a CUDA-graph padding row; and
on prefill GPUs one extend chunk (row t sees (t+1)//4 positions of the request's own pages). The
largest decode batch is also captured in a CUDA graph and replayed. Upstream's torch function
gathers every page of the table, so it runs at B=1 only.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, check_rows, registry_function

PATCH = "indexer"
HEADS = 64
PAGE = 64  # compressed positions per page (256 tokens)
REL_TOL = 1e-3  # max |error| over valid positions / max |logit| of the call
POOL_PAGES = 4096  # rows share one pool (their tables point into it at random)
_ARGS = ("q_fp8", "kvcache_fp8", "weight", "seq_lens", "page_table", "deep_gemm_metadata", "max_seq_len",
         "clean_logits")


def cases(target: Target) -> List[Case]:
    from v4flash_kernels.indexer.reference import IndexerCase

    out = [
        _small("small B=4 pad row", target, IndexerCase(batch=4, width=6, lengths=[300, 1, 129], pad_rows=1)),
        _small("small B=3 neg table, strided w", target,
               IndexerCase(batch=3, width=5, lengths=[70, 320, 64], table_pad="neg", weight_strided=True)),
    ]
    if target.small_only:
        return out
    width = math.ceil(target.context / 256)
    largest = max(target.decode_rows)
    for b in target.decode_rows:
        out.append(_production(f"decode B={b} context {target.context}", target,
                               lambda seed, b=b: decode_inputs(b, width, seed, target.device),
                               graph=b == largest, upstream=b == 1))
    if target.prefill_rows:
        t = target.prefill_rows
        out.append(_production(f"prefill T={t}", target, lambda seed: prefill_inputs(t, seed, target.device),
                               graph=False, upstream=False))
    return out


def _ours(kw: Inputs) -> Any:
    return registry_function(PATCH)(*(kw[a] for a in _ARGS))


_UPSTREAM: Dict[str, Any] = {}


def _upstream(kw: Inputs) -> Any:
    if "mod" not in _UPSTREAM:
        from v4flash_kernels.upstream import load_indexer

        _UPSTREAM["mod"] = load_indexer()
    return _UPSTREAM["mod"].fp8_paged_mqa_logits_torch_sm120(*(kw[a] for a in _ARGS))


def _small(name: str, target: Target, case: Any) -> Case:
    from v4flash_kernels.indexer.reference import make_indexer_inputs

    return Case(name, SMALL, lambda seed: _meta(make_indexer_inputs(case, device=target.device, seed=seed), target),
                _ours, _reference, _compare, upstream=_upstream)


def _production(name: str, target: Target, make: Any, graph: bool, upstream: bool) -> Case:
    return Case(name, PRODUCTION, lambda seed: _meta(make(seed), target), _ours, _reference, _compare,
                upstream=_upstream if upstream else None,
                upstream_skip="" if upstream else "upstream gathers every page of the table in fp32: B=1 only",
                graph=graph)


def _meta(kw: Inputs, target: Target) -> Inputs:
    import torch

    kw["_rows"] = torch.tensor(check_rows(kw["q_fp8"].shape[0], 16), device=target.device)
    return kw


def _common(batch: int, seed: int, device: str) -> Tuple[Any, ...]:
    import torch

    from v4flash_kernels.indexer.reference import HEAD_DIM, make_pool

    g = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(POOL_PAGES, torch.Generator(device=device).manual_seed(seed + 1), device)
    q = (torch.randn((batch, 1, HEADS, HEAD_DIM), generator=g, device=device) * 2.0).to(torch.float8_e4m3fn)
    weight = torch.randn((batch, HEADS), generator=g, device=device) * 0.05
    return g, pool.view(POOL_PAGES, PAGE, 1, HEAD_DIM + 4), q, weight


def decode_inputs(batch: int, width: int, seed: int, device: str) -> Inputs:
    """Row 0 spans the whole configured context, the others random lengths; the last row of a batch
    > 2 is CUDA-graph padding (length 1, a table row of zeros); table columns past a row's length
    hold stale pages, as SGLang's do."""
    import torch

    g, pool, q, weight = _common(batch, seed, device)
    msl = PAGE * width
    lens = torch.randint(1, msl + 1, (batch,), generator=g, device=device)
    lens[0] = msl
    table = torch.randint(1, POOL_PAGES, (batch, width), generator=g, device=device, dtype=torch.int32)
    if batch > 2:
        lens[-1] = 1
        table[-1] = 0
    return {"q_fp8": q, "kvcache_fp8": pool, "weight": weight, "seq_lens": lens.to(torch.int32).unsqueeze(-1),
                "page_table": table, "deep_gemm_metadata": None, "max_seq_len": msl, "clean_logits": False}


def prefill_inputs(rows: int, seed: int, device: str) -> Inputs:
    """One extend chunk of one request: every row shares the request's table; row t has (t+1)//4 positions."""
    import torch

    g, pool, q, weight = _common(rows, seed, device)
    width = math.ceil(rows / 256)
    msl = PAGE * width
    pages = torch.randperm(POOL_PAGES - 1, generator=g, device=device)[:width].to(torch.int32) + 1
    table = pages.unsqueeze(0).expand(rows, width).contiguous()
    lens = (torch.arange(rows, device=device) + 1) // 4
    return {"q_fp8": q, "kvcache_fp8": pool, "weight": weight, "seq_lens": lens.to(torch.int32).unsqueeze(-1),
                "page_table": table, "deep_gemm_metadata": None, "max_seq_len": msl, "clean_logits": False}


def _reference(kw: Inputs) -> Any:
    from v4flash_kernels.indexer.reference import indexer_logits_ref

    r = kw["_rows"]
    return indexer_logits_ref(kw["q_fp8"][r], kw["kvcache_fp8"], kw["weight"][r], kw["seq_lens"][r],
                              kw["page_table"][r], kw["max_seq_len"])


def _compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    import torch

    from v4flash_kernels.indexer.reference import logits_error

    want = (kw["q_fp8"].shape[0], int(kw["max_seq_len"]))
    if tuple(out.shape) != want or out.dtype != torch.float32:
        return Comparison(False, {}, f"result is {tuple(out.shape)} {out.dtype}, expected {want} torch.float32")
    nan_any = bool(torch.isnan(out).any())
    e = logits_error(out[kw["_rows"]], ref)
    problems = []
    if nan_any:
        problems.append("NaN in the logits")
    if not e["inf_ok"]:
        problems.append("-inf is not exactly at the positions past each row's length")
    if not e["rel_err"] <= REL_TOL:
        problems.append(f"rel. error {e['rel_err']:.3g} > {REL_TOL:g}")
    return Comparison(not problems, dict(e, nan_any=nan_any, rows_checked=int(kw["_rows"].numel())),
                      "; ".join(problems))
