"""What every kernel bench shares: one CUDA-graph timer and the per-row summary of a variants table.

One timer so that numbers from different benches (and the step bench) are measured the same way:
a CUDA graph holding one call (so launch overhead is what serving under graphs pays), L2 flushed
before each replay by `triton.testing.do_bench`, the median of the replays.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple


def time_graph(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median µs per replay of a CUDA graph holding one call of `fn` (L2 flushed by do_bench)."""
    import torch
    import triton

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(g.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del g
    return ms * 1e3


def variant_summary(v: Dict[str, dict]) -> Tuple[float, str, float, float, float, str]:
    """(ours µs, fastest correct variant of ours, its µs, upstream µs, worst rel. err, "  FAIL:..." or "")
    of one row's variants: the columns every kernel bench's table shares."""
    ours = v["ours"]["us"]
    mine = {k: x for k, x in v.items() if k != "upstream" and x["ok"]}
    best_name = min(mine, key=lambda k: mine[k]["us"]) if mine else "-"
    best = mine[best_name]["us"] if mine else float("nan")
    up = v.get("upstream", {}).get("us", float("nan"))
    err = max(x["rel_err"] for k, x in v.items() if k != "upstream")
    bad = "" if all(x["ok"] for x in v.values()) else "  FAIL:" + ",".join(k for k, x in v.items() if not x["ok"])
    return ours, best_name, best, up, err, bad
