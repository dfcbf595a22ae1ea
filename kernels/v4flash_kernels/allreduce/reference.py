"""fp64 reference of the all-reduce and the tolerance the kernels are held to.

The definition: out = x_0 + x_1 + ... + x_{N-1}, elementwise, rounded once to the output dtype.
The kernels add in rank order in fp32 and round once; an fp32 sum of N terms is within N ulps of
fp32 of the exact sum, far below one ulp of bf16/fp16, so the output is the exact sum rounded
(within one output ulp), and exactly the exact sum when every partial sum is representable.
"""

from __future__ import annotations

from typing import Sequence

import torch


def all_reduce_ref(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The exact sum in fp64 (every input is exactly representable in fp64)."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float64, device=xs[0].device)
    for x in xs:
        acc += x.to(torch.float64)
    return acc


MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def rank_order_sum(xs: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """What the kernels compute, bit for bit on a GPU: fp32 accumulation in rank order, one rounding."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32, device=xs[0].device)
    for x in xs:
        acc += x.to(torch.float32)
    return acc.to(dtype)


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at each |ref| (flat below the smallest normal)."""
    mag = ref.abs().to(torch.float64).clamp_min(torch.finfo(dtype).tiny)
    return torch.pow(2.0, torch.floor(torch.log2(mag)) - MANTISSA_BITS[dtype])


def max_ulp_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |out - ref| in ulps of out's dtype at ref (0.5 = correctly rounded)."""
    err = (out.to(torch.float64) - ref).abs()
    return float((err / ulp(ref, out.dtype)).max()) if err.numel() else 0.0
