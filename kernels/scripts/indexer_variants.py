"""The indexer logits' measured-and-dropped register prefetch, kept runnable for A/B runs.

No config in `v4flash_kernels.indexer.op` launches it, so it lives here and not in the shipped
`indexer_logits_kernel` (whose code is then exactly what runs). Same grid, same loads, same math
and the same -inf tail as the shipped kernel, with the keys of the next tile and the page ids of
the one after that in flight while the current tile is computed. H200 (kernels/BENCH.md,
"Indexer", round 3): no faster than the shipped single-page tiles.

Each config is checked against the fp64 reference on a NaN-poisoned output, then timed next to the
shipped kernel with the same tile, warps and programs per row under CUDA-graph replay (L2 flushed,
median):

    PYTHONPATH=kernels python kernels/scripts/indexer_variants.py [--json PATH]   # GPU, ~1 min
    TRITON_INTERPRET=1 PYTHONPATH=kernels python kernels/scripts/indexer_variants.py --cpu   # check only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import List

import torch
import triton
import triton.language as tl

from v4flash_kernels.indexer import op as indexer
from v4flash_kernels.indexer.kernel import HEAD_DIM, PAGE, _fix_page, _load_keys, _store_logits
from v4flash_kernels.kit.device import num_sms


@triton.jit
def indexer_logits_prefetch_kernel(
    Q, stride_qb, stride_qh,
    K8, KS, stride_kp8, stride_kps,
    W, stride_wb, stride_wh,
    SEQ, stride_sb,
    PT, stride_pb,
    OUT, stride_ob,
    H, max_seq_len, num_pages,
    BLOCK_H: tl.constexpr,
    PAGES: tl.constexpr,
    FILL: tl.constexpr,
    DOT_F16: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    b = tl.program_id(1).to(tl.int64)
    TILE: tl.constexpr = PAGES * PAGE
    t_off = tl.arange(0, TILE)
    out_row = OUT + b * stride_ob
    pt_row = PT + b * stride_pb

    seq = tl.load(SEQ + b * stride_sb)
    pos = pid * TILE + t_off
    page = tl.load(pt_row + pos // PAGE, mask=pos < max_seq_len, other=0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    hmask = h < H
    q = tl.load(Q + b * stride_qb + h[None, :] * stride_qh + d[:, None], mask=hmask[None, :], other=0.0)
    w = tl.load(W + b * stride_wb + h * stride_wh, mask=hmask, other=0.0).to(tl.float32)
    q = q.to(tl.float16) if DOT_F16 else q.to(tl.float32)
    n = tl.minimum(tl.maximum(seq, 0), max_seq_len).to(tl.int32)
    n_tiles = tl.cdiv(n, TILE)

    # Keys one tile ahead and page ids two tiles ahead (masked-off loads past the length cost nothing).
    step = nprog * TILE
    valid = pos < n
    k, sc = _load_keys(K8, KS, stride_kp8, stride_kps, _fix_page(page, num_pages), pos, valid)
    page_n = tl.load(pt_row + (pos + step) // PAGE, mask=pos + step < n, other=0)
    for t in range(pid, n_tiles, nprog):
        pos = t * TILE + t_off
        valid = pos < n
        pos_n = pos + step
        valid_n = pos_n < n
        k_n, sc_n = _load_keys(K8, KS, stride_kp8, stride_kps, _fix_page(page_n, num_pages), pos_n, valid_n)
        page_n = tl.load(pt_row + (pos_n + step) // PAGE, mask=pos_n + step < n, other=0)
        _store_logits(out_row, k, sc, q, w, pos, valid, max_seq_len, DOT_F16)
        k, sc = k_n, sc_n

    tail0 = n_tiles * TILE
    n_fill = tl.cdiv(tl.maximum(max_seq_len - tail0, 0), FILL)
    f_off = tl.arange(0, FILL)
    neg = tl.full((FILL,), float("-inf"), tl.float32)
    for f in range(pid, n_fill, nprog):
        pos_f = tail0 + f * FILL + f_off
        tl.store(out_row + pos_f, neg, mask=pos_f < max_seq_len)


# What round 3 measured with the prefetch: the shipped tile and programs per SM, plus the swept
# 1-, 2- and 4-page tiles.
CONFIGS = (indexer.DEFAULT,) + tuple(
    indexer.IndexerConfig(pages=p, num_warps=w, num_stages=1, ctas_per_sm=c)
    for p, w in ((1, 4), (2, 8), (4, 8)) for c in (8, 16)
)


def run_prefetch(kw: dict, cfg: indexer.IndexerConfig, out: torch.Tensor | None = None,
                 nprog: int | None = None) -> torch.Tensor:
    """The logits through the prefetch kernel, launched exactly as `indexer.run` launches the shipped one."""
    q, kv, weight, page_table = kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["page_table"]
    seq_lens = kw["seq_lens"].reshape(-1)
    msl = int(kw["max_seq_len"])
    batch, _, heads, head_dim = q.shape
    if out is None:
        out = torch.empty((batch, msl), dtype=torch.float32, device=q.device)
    flat = kv.view(-1, indexer.PAGE * (head_dim + 4)).view(torch.uint8)
    k8, ks = flat.view(torch.float8_e4m3fn), flat.view(torch.float32)
    if nprog is None:
        nprog = indexer.programs_per_row(batch, -(-msl // indexer.PAGE), num_sms(q.device), cfg)
    dot_f16 = q.dtype == torch.float8_e4m3fn and os.environ.get("TRITON_INTERPRET") != "1"
    indexer_logits_prefetch_kernel[(nprog, batch)](
        q, q.stride(0), q.stride(2), k8, ks, k8.stride(0), ks.stride(0), weight, weight.stride(0), weight.stride(1),
        seq_lens, seq_lens.stride(0), page_table, page_table.stride(0), out, out.stride(0), heads, msl, kv.shape[0],
        BLOCK_H=max(16, triton.next_power_of_2(heads)), PAGES=cfg.pages, FILL=cfg.fill, DOT_F16=dot_f16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def check(kw: dict, cfg: indexer.IndexerConfig, ref: torch.Tensor, nprog: int | None = None) -> dict:
    from v4flash_kernels.indexer.reference import logits_error

    poison = torch.full((kw["q_fp8"].shape[0], int(kw["max_seq_len"])), float("nan"), dtype=torch.float32,
                        device=kw["q_fp8"].device)
    e = logits_error(run_prefetch(kw, cfg, out=poison, nprog=nprog), ref)
    return dict(e, ok=(not e["nan"]) and e["inf_ok"] and e["rel_err"] <= 1e-3)


def cpu_check() -> int:
    """Every config, several program splits, tiny shapes under the interpreter: correctness only."""
    from v4flash_kernels.indexer.reference import IndexerCase, make_indexer_inputs, reference_for
    from v4flash_kernels.interpreter import fix_index, interpreting

    if not interpreting():
        print("--cpu needs TRITON_INTERPRET=1 (set before Triton is imported)", file=sys.stderr)
        return 2
    fix_index()
    kw = make_indexer_inputs(IndexerCase(batch=2, width=9, heads=64, lengths=[500, 130]), seed=7)
    ref = reference_for(kw)
    bad = 0
    for cfg in (c for c in CONFIGS if c.ctas_per_sm == 8):  # 1-, 2- and 4-page tiles
        for nprog in (1, 2, 5):
            rec = check(kw, cfg, ref, nprog)
            print(cfg.name, f"nprog={nprog}", rec, flush=True)
            bad += not rec["ok"]
    return 1 if bad else 0


GPU_SHAPES = ((1, "128K", "4K"), (1, "1M", "128K"), (16, "128K", "128K"), (64, "128K", "128K"))


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="check every config on tiny shapes (TRITON_INTERPRET=1)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "indexer_variants.json"))
    ap.add_argument("--budget-s", type=float, default=80)
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_check()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from v4flash_bench.indexer import Shape
    from v4flash_kernels.indexer.reference import IndexerCase, make_indexer_inputs, reference_for
    from v4flash_kernels.kit.measure import time_graph

    t0 = time.time()
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "rows": []}
    for i, (b, ctx, actual) in enumerate(GPU_SHAPES):
        if time.time() - t0 > args.budget_s:
            break
        sh = Shape(b, ctx, actual)
        kw = make_indexer_inputs(IndexerCase(batch=b, width=sh.width, lengths=[sh.c4_len]), device="cuda", seed=700 + i)
        ref = reference_for(kw)
        row: dict = {"batch": b, "context": ctx, "actual": actual, "variants": {}}
        for cfg in CONFIGS:
            rec = check(kw, cfg, ref)
            prefetch = functools.partial(run_prefetch, kw, cfg)
            shipped = functools.partial(indexer.run, kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["seq_lens"],
                                        kw["page_table"], kw["max_seq_len"], config=cfg)
            rec["prefetch_us"] = time_graph(prefetch, rep_ms=40) if rec["ok"] else float("nan")
            rec["shipped_us"] = time_graph(shipped, rep_ms=40)
            row["variants"][cfg.name] = rec
            print(f"[{time.time() - t0:5.1f}s] B={b} ctx={ctx} actual={actual} {cfg.name}: ok={rec['ok']} "
                  f"prefetch {rec['prefetch_us']:.1f} us vs shipped {rec['shipped_us']:.1f} us", flush=True)
        res["rows"].append(row)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        del kw, ref
        torch.cuda.empty_cache()
    return 0 if all(r["ok"] for row in res["rows"] for r in row["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
