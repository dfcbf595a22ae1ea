"""N ranks on one GPU: N registered buffers standing in for the peers, one stream per rank.

The real flag protocol runs: every "rank" launches its own kernel on its own stream, the kernels
spin on each other's flags concurrently, and they must all be resident at once (N x the plan's
CTAs, far below one GPU's capacity). Only the link differs from a real group (the GPU's own
memory instead of PCIe/NVLink), so timings here measure the protocol's overhead, not a box.
Used by the single-GPU tests and `bench --simulate`; captured into a CUDA graph it replays as is.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from v4flash_kernels.allreduce import plan as P
from v4flash_kernels.allreduce.launch import launch


class LocalRanks:
    def __init__(self, world: int, device: torch.device | str = "cuda", layout: P.Layout = P.Layout()) -> None:
        if not P.world_ok(world):
            raise ValueError(f"world {world}: not one of {P.WORLDS}")
        self.world, self.layout, self.device = world, layout, torch.device(device)
        self.buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=self.device) for _ in range(world)]
        self.peers = tuple(b.data_ptr() for b in self.buffers)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world)]

    def epochs(self) -> List[int]:
        """Each rank's stored epoch (calls finished), read back from its buffer."""
        return [int(b[: 8].view(torch.int64).item()) for b in self.buffers]

    def all_reduce(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor] | None = None,
                   two_shot: bool | None = None, ctas: int | None = None) -> List[torch.Tensor]:
        """outs[r] = sum of xs (one kernel per rank, each on its own stream, joined back to the current one)."""
        outs = list(outs) if outs is not None else [torch.empty_like(x) for x in xs]
        cur = torch.cuda.current_stream(self.device)
        for r in range(self.world):
            s = self.streams[r]
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                launch(xs[r], outs[r], self.peers, r, self.layout, two_shot=two_shot, ctas=ctas)
        for s in self.streams:
            cur.wait_stream(s)
        return outs
