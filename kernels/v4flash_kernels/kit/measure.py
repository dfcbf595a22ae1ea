"""How every bench measures a GPU: the CUDA-graph timers and the copy bandwidth.

Two ways to time a graph, one module, so numbers from different benches (and the step bench) are
measured the same way: `time_graph`, a CUDA graph holding one call (so launch overhead is what serving
under graphs pays), L2 flushed before each replay by `triton.testing.do_bench`, the median of the
replays over fixed warm-up/measure windows; `time_replay`, the step bench's, which flushes L2 itself
and stops after a time budget so that slow upstream shapes (seconds per call) cost a few replays.
torch and triton are imported when a timer runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Tuple


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
    return float(ms) * 1e3


BUDGET_S = 0.2  # time spent replaying one op after its first replay
MAX_REPS = 20

_flush: Dict[int, Any] = {}


def _flush_l2() -> None:
    import torch

    if 0 not in _flush:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        _flush[0] = torch.empty(max(256 << 20, 4 * l2), dtype=torch.int8, device="cuda")
    _flush[0].zero_()


def time_replay(run: Callable[[], object], calls: int, budget_s: float = BUDGET_S,
                max_reps: int = MAX_REPS) -> Tuple[float, int]:
    """Median µs per call over graph replays of `run` (which makes `calls` calls), L2 flushed before
    each replay; the first replay is discarded when there are more."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: List[float] = []
    t0 = time.time()
    while len(samples) < max_reps:
        _flush_l2()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
        spent = time.time() - t0
        if spent > budget_s and (len(samples) >= 3 or samples[-1] > budget_s * 1e6 / 4):
            break
    del g
    kept = samples[1:] if len(samples) > 1 else samples
    return statistics.median(kept) / calls, len(samples)


def graph_overhead_us() -> float:
    """One replay of a graph holding one tiny kernel, timed like the ops (for reading small ops)."""
    import torch

    x = torch.zeros(1, device="cuda")
    us, _ = time_replay(lambda: x.add_(1.0), 1)
    return us


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth (bytes/s, read + write) of the running GPU."""
    import torch

    n = 1 << 30
    a = torch.empty(n, dtype=torch.int8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return float(2 * n / min(ts))
