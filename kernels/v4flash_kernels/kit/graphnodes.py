"""How many kernels a CUDA graph launches: the count the step bench reports per op row and per step.

A decode step is what SGLang replays from a CUDA graph, so "kernels per step" is the number of
kernel nodes in the graph that holds it. torch keeps the captured `cudaGraph_t` when the graph is
made with `keep_graph=True`; the driver's `cuGraphGetNodes` / `cuGraphNodeGetType` (through ctypes)
then count its nodes by type. Memset and memcpy nodes are
counted apart: they are not kernels, but they are graph nodes the GPU still runs one by one.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Dict

# CUgraphNodeType (the runtime's cudaGraphNodeType has the same numbers)
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_memop", 13: "conditional"}


@dataclass(frozen=True)
class NodeCount:
    kernels: int
    other: Dict[str, int]

    @property
    def total(self) -> int:
        return self.kernels + sum(self.other.values())


def _driver() -> Any:
    """The CUDA driver (libcuda.so.1): a `cudaGraph_t` is the driver's `CUgraph`, and the driver is the
    one library of that name in a CUDA process. The runtime is not: TileLang maps a `libcudart_stub`
    that lacks the graph functions (seen on the H200, 2026-12-02), and /proc/self/maps found it first."""
    return ctypes.CDLL("libcuda.so.1")


def count_nodes(graph_handle: int) -> NodeCount:
    """Kernel and other nodes of a `cudaGraph_t` (an int, as `CUDAGraph.raw_cuda_graph()` returns it)."""
    try:
        drv = _driver()
    except OSError as exc:
        raise RuntimeError(f"the CUDA driver library is not loadable ({exc}): no CUDA here?") from None
    n = ctypes.c_size_t(0)
    graph = ctypes.c_void_p(graph_handle)
    err = drv.cuGraphGetNodes(graph, None, ctypes.byref(n))
    if err:
        raise RuntimeError(f"cuGraphGetNodes failed (CUresult {err})")
    nodes = (ctypes.c_void_p * max(1, n.value))()
    err = drv.cuGraphGetNodes(graph, nodes, ctypes.byref(n))
    if err:
        raise RuntimeError(f"cuGraphGetNodes failed (CUresult {err})")
    kernels = 0
    other: Dict[str, int] = {}
    for i in range(n.value):
        t = ctypes.c_int(-1)
        if drv.cuGraphNodeGetType(ctypes.c_void_p(nodes[i]), ctypes.byref(t)):
            raise RuntimeError("cuGraphNodeGetType failed")
        name = NODE_TYPES.get(t.value, f"type{t.value}")
        if name == "kernel":
            kernels += 1
        else:
            other[name] = other.get(name, 0) + 1
    return NodeCount(kernels, other)


def kernels_in(fn: Callable[[], Any]) -> NodeCount:
    """Capture one call of `fn` (after a warm-up call on a side stream, as SGLang captures) and count
    the graph's nodes. Raises where this torch cannot keep the captured graph."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    try:
        return count_nodes(int(g.raw_cuda_graph()))
    finally:
        del g
