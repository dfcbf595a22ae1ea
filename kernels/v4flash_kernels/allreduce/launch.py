"""One kernel launch of the all-reduce: a `plan.Plan`, this rank's input/output, every rank's buffer address.

Shared by the communicator (real peers through CUDA IPC), the one-GPU simulation (N buffers on one
device) and the CPU tests (the interpreter, buffers in shared memory).
"""

from __future__ import annotations

from typing import Sequence

import torch

from v4flash_kernels.allreduce import kernel as _k
from v4flash_kernels.allreduce import plan as P

DTYPES = (torch.bfloat16, torch.float32)  # what check_sm120 compiles; fp16 and others stay with NCCL


def launch(x: torch.Tensor, out: torch.Tensor, peers: Sequence[int], rank: int, layout: P.Layout,
           two_shot: bool | None = None, ctas: int | None = None, spin_limit: int = 0,
           compile_only: bool = False) -> P.Plan:
    """out = sum over ranks of x (same shape and dtype, contiguous; out may be x). Returns the plan used.

    `peers[r]` is rank r's buffer as addressed from this process (`peers[rank]` the own one). Every
    rank must launch the same sequence of calls with the same sizes: that is the collective's contract.
    `two_shot` / `ctas` force the algorithm / grid (tests, bench); `spin_limit` > 0 bounds the flag
    waits (the start-up probe: a time-out sets the buffer's error word, `STATE_ERROR`). `compile_only`
    builds the binary this call would run without starting it (so ranks can compile first, then meet).
    """
    world = len(peers)
    p = P.plan(x.numel(), x.element_size(), world, layout, two_shot, ctas)
    args = list(peers) + [peers[rank]] * (P.MAX_RANKS - world)  # unused slots: any valid 64-bit address
    common = {"WORLD": world, "BLOCK": p.block, "DATA_OFF": P.DATA_OFF, "HALF_BYTES": layout.half_bytes,
              "FLAGS1_OFF": P.FLAGS1_OFF, "MAX_CTAS": P.MAX_CTAS, "SPIN_LIMIT": spin_limit,
              "num_warps": P.NUM_WARPS, "num_stages": 1}
    kernel = _k.two_shot_kernel if p.two_shot else _k.one_shot_kernel
    if p.two_shot:
        common["FLAGS2_OFF"] = P.FLAGS2_OFF
    if compile_only:
        kernel.warmup(x, out, *args, rank, p.numel, p.slot, p.span, grid=(p.ctas,), **common)
    else:
        kernel[(p.ctas,)](x, out, *args, rank, p.numel, p.slot, p.span, **common)
    return p
