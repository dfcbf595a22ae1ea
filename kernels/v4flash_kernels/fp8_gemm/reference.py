"""fp64 reference of the 128x128 block-scaled FP8 GEMM / linear, and test inputs.

The format and the activation quant are `kit.fp8`; the product is `A_deq @ W_deq^T`, evaluated here in
fp64 (the kernels accumulate in fp32 and round once to the output dtype).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from v4flash_kernels.kit.fp8 import FP8, GROUP, dequant_activation, dequant_weight, quantize_activation_ref


def matmul_ref(a: torch.Tensor, w: torch.Tensor, a_s: torch.Tensor, ws: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(A_deq @ W_deq^T, |A_deq| @ |W_deq|^T) in fp64, over a's leading dims; the second bounds rounding."""
    ad = dequant_activation(a, a_s)
    wd = dequant_weight(w, ws)
    return ad @ wd.t(), ad.abs() @ wd.abs().t()


def linear_ref(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
               bias: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The linear on its quantized activation, fp64 (+ bias); and the rounding bound as in `matmul_ref`."""
    q, s = quantize_activation_ref(x)
    out, mag = matmul_ref(q, w, s, ws)
    if bias is not None:
        out = out + bias.double()
        mag = mag + bias.double().abs()
    return out, mag


# ----------------------------------------------------------------------------- inputs


def make_weight(n: int, k: int, gen: torch.Generator, device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight spanning the code range and per-block fp32 scales of a few magnitudes."""
    w = (torch.randn((n, k), generator=gen, device=device) * 64).clamp(-448, 448).to(FP8)
    ws = torch.rand((math.ceil(n / GROUP), math.ceil(k / GROUP)), generator=gen, device=device) * 2e-4 + 1e-5
    return w, ws


def make_activation(m: int, k: int, gen: torch.Generator, device: str = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows with outliers, a zero group and a tiny group: the quant's edge cases."""
    x = torch.randn((m, k), generator=gen, device=device)
    x = x * torch.exp2(torch.randint(-4, 5, (m, 1), generator=gen, device=device).float())
    if m and k >= 2 * GROUP:
        x[0, :GROUP] = 0.0
        x[-1, GROUP:2 * GROUP] *= 1e-6
    if m and k:
        x[m // 2, k // 3] = 300.0
    return x.to(dtype)


def make_quantized(m: int, k: int, gen: torch.Generator, device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """A pre-quantized activation (codes, fp32 scales) for any K (the last group may be partial)."""
    a = (torch.randn((m, k), generator=gen, device=device) * 64).clamp(-448, 448).to(FP8)
    a_s = torch.rand((m, math.ceil(k / GROUP)), generator=gen, device=device) * 1e-2 + 1e-4
    return a, a_s
