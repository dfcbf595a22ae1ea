"""N "ranks" as N spawned processes running the all-reduce kernels under Triton's interpreter (CPU).

Each process maps the same shared-memory buffers (torch `share_memory_()`), so, exactly as with
CUDA IPC, every process addresses its peers' buffers at its own addresses and the kernels' flags
and data really cross process boundaries; the interpreter's atomics are real atomics. Kept free of
pytest: the children import only this module.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import List, Sequence

import torch
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Call:
    numel: int
    dtype: torch.dtype = torch.bfloat16
    two_shot: bool | None = None
    ctas: int | None = None
    in_place: bool = False


def _child(rank: int, bufs: Sequence[torch.Tensor], xs: Sequence[Sequence[torch.Tensor]],
           outs: Sequence[Sequence[torch.Tensor]], calls: Sequence[Call], max_bytes: int, q) -> None:
    try:
        os.environ["TRITON_INTERPRET"] = "1"
        from v4flash_kernels.interpreter import fix_index

        fix_index()
        from v4flash_kernels.allreduce import plan as P
        from v4flash_kernels.allreduce.launch import launch

        peers = [b.data_ptr() for b in bufs]
        names = []
        for i, c in enumerate(calls):
            x = xs[i][rank]
            out = x if c.in_place else outs[i][rank]
            names.append(launch(x, out, peers, rank, P.Layout(max_bytes), two_shot=c.two_shot, ctas=c.ctas).name)
        q.put((rank, True, names))
    except Exception:
        q.put((rank, False, traceback.format_exc()))


def run(world: int, calls: Sequence[Call], inputs: Sequence[Sequence[torch.Tensor]], max_bytes: int,
        timeout: float = 600.0) -> tuple:
    """Run `calls` on `world` processes; inputs[i][r] is rank r's input of call i (CPU tensors).

    Returns (outputs[i][r], plan names per rank, the buffers) after every child finished.
    """
    from v4flash_kernels.allreduce import plan as P

    layout = P.Layout(max_bytes)
    bufs = [torch.zeros(layout.total_bytes, dtype=torch.uint8).share_memory_() for _ in range(world)]
    xs = [[t.clone().share_memory_() for t in per_rank] for per_rank in inputs]
    outs = [[torch.full_like(t, float("nan")).share_memory_() for t in per_rank] for per_rank in inputs]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, bufs, xs, outs, list(calls), max_bytes, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: List[tuple] = []
    try:
        for _ in procs:
            results.append(q.get(timeout=timeout))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = [r for r in results if not r[1]]
    if failed:
        raise AssertionError(f"rank {failed[0][0]} failed:\n{failed[0][2]}")
    names = {r[0]: r[2] for r in results}
    got = [[xs[i][r] if c.in_place else outs[i][r] for r in range(world)] for i, c in enumerate(calls)]
    return got, [names[r] for r in range(world)], bufs
