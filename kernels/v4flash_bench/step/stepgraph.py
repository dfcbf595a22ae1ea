"""The step as it runs: every call of one decode step, layer after layer, in one CUDA graph.

The per-op rows time each op alone (its own graph of rotated calls) and sum them; a real step is
one graph of ~1,000 kernels back to back, where each kernel's ramp-up and tail sit between its
neighbours. So the same ops are also captured as one step: for each of the 43 layers in order,
that layer's calls of every op in the bench's op order, each call on the next of the op's rotated
input sets (weights not in L2 from the previous layer), then replayed with L2 flushed. Its time
stands next to the per-op sum, and its kernel nodes are the step's kernel count.

What this graph is not: the ops read their own inputs, not the previous op's output (no data
dependence, as in the per-op rows); within a layer they follow the bench's op order, not
SGLang's exact order (the calls and kernels are the same); ops built with one input set
(attention, indexer, top-k, the glue) reuse it in every layer, so their caches can stay in L2
where a real step reads 43 layers' caches. The all-reduces are not in it (one GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Tuple

from v4flash_bench.step import model as M
from v4flash_bench.step.results import Measurement

KINDS = ("window", "c4", "c128")


@dataclass(frozen=True)
class StepGraph:
    spec: str
    path: str
    ms: float  # one replay of the whole step's graph (NaN when it could not be built or captured)
    kernels: int  # kernel nodes of that graph
    other_nodes: Dict[str, int]
    calls: int  # op calls captured
    error: str | None = None


def _layers_of(op: M.Op) -> List[int]:
    """The layers an op runs in: its attention kind's, else the kind whose layer count is its count
    (the c4-only indexer and compressors: 21; c128: 20; the window layers: 2), else all 43."""
    kinds = M.layer_kinds()
    counts = M.layer_counts()
    kind = op.p.get("kind")
    if kind not in KINDS:
        kind = next((k for k in KINDS if op.count == counts[k] and counts[k] != counts["all"]), None)
    return [i for i, k in enumerate(kinds) if kind is None or k == kind]


def schedule(ops: List[M.Op]) -> List[Tuple[int, M.Op, int]]:
    """Pure: (layer, op, calls in that layer) in step order. An op's calls spread evenly over its
    layers, the first layers taking one more where the count does not divide (85 fused mHC
    boundaries over 43 layers: 2 in each but the last); a count of 1 lands in the last layer."""
    per_layer: Dict[int, List[Tuple[M.Op, int]]] = {}
    for op in ops:
        layers = _layers_of(op)
        if op.count <= 0:
            continue
        if op.count == 1:
            per_layer.setdefault(layers[-1], []).append((op, 1))
            continue
        base, extra = divmod(op.count, len(layers))
        for j, layer in enumerate(layers):
            n = base + (1 if j < extra else 0)
            if n:
                per_layer.setdefault(layer, []).append((op, n))
    return [(layer, op, n) for layer in sorted(per_layer) for op, n in per_layer[layer]]


def impl_of(op: M.Op, path: str, meas: Mapping[Tuple[str, str], Measurement]) -> str:
    """The implementation `path` runs for `op`, as `results.path_times` picks it."""
    variant = op.p.get("variant")
    if variant is not None:
        return "upstream" if variant == "upstream" else "ours"
    mine = meas.get((op.key, "ours"))
    return "ours" if path == "patched" and mine is not None and mine.error is None and mine.ok else "upstream"


def measure(spec: M.StepSpec, path: str, meas: Mapping[Tuple[str, str], Measurement], seed: int,
            l2: int) -> StepGraph:
    """Build every op of the step's path once, capture the whole step, count its nodes and time it."""
    import torch

    from v4flash_bench.step import ops as O
    from v4flash_bench.step.ops.common import op_seed
    from v4flash_kernels.kit.graphnodes import count_nodes
    from v4flash_kernels.kit.measure import time_replay

    ops = M.ops_for_path(M.step_ops(spec), path)
    failed = [op.key for op in ops if not meas.get((op.key, impl_of(op, path, meas)),
                                                     Measurement("", "", "", 0.0, 0, 0, False, 0.0, "", "")).ok]
    if failed:
        return StepGraph(spec.label, path, float("nan"), 0, {}, 0, f"not built: {failed[0]} failed its check")
    preps = {}
    try:
        for op in ops:
            if op.key not in preps:
                preps[op.key] = O.build(op, impl_of(op, path, meas), l2, op_seed(seed, op.key))
        order = schedule(ops)
        turn: Dict[str, int] = {}

        def step() -> None:
            for _layer, op, n in order:
                for _ in range(n):
                    i = turn.get(op.key, 0)
                    preps[op.key].call(i)
                    turn[op.key] = i + 1

        calls = sum(n for _l, _o, n in order)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            step()
        torch.cuda.synchronize()
        nodes = count_nodes(int(g.raw_cuda_graph()))
        del g
        us, _reps = time_replay(step, 1)
        return StepGraph(spec.label, path, us / 1e3, nodes.kernels, nodes.other, calls)
    except Exception as exc:  # reported beside the per-op sum; the run goes on
        return StepGraph(spec.label, path, float("nan"), 0, {}, 0, f"{type(exc).__name__}: {exc}")
    finally:
        preps.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
