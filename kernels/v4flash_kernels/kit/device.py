"""Per-device facts and buffers the kernels' host code shares: zeroed int32 counters, the SM count."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch


class Counters:
    """Zeroed int32 counters per device and stream (arrival counters, split-K tickets).

    Zeroed once when allocated; every kernel that uses them leaves them at zero again (its last program
    resets them), so CUDA graphs replay with no reset kernel. Two streams never share a buffer. Buffers
    are never freed: a captured graph keeps the pointer it was captured with.
    """

    def __init__(self) -> None:
        self._live: Dict[Tuple[Any, ...], torch.Tensor] = {}
        self._old: List[torch.Tensor] = []

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        """At least `n` zeroed counters for the current stream of `device`."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device.type, device.index, stream)
        buf = self._live.get(key)
        if buf is None or buf.numel() < n:
            if buf is not None:
                self._old.append(buf)
            buf = torch.zeros(max(1024, 1 << (n - 1).bit_length()), dtype=torch.int32, device=device)
            self._live[key] = buf
        return buf


# The cooperative merges' counters (attention: arrivals and departures per row and head block; mHC and
# the MoE split-K: one per block), one pool shared by every op that counts arrivals.
_ARRIVALS = Counters()


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    return _ARRIVALS.get(device, n)


_SMS: Dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """SM count, cached per device; host-only (no sync), so safe during CUDA-graph capture."""
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]
