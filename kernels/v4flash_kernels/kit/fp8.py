"""The 128x128 block-scaled FP8 format from its definition: quantization and fp64 dequantization.

A weight `W [N, K]` of e4m3 codes with one fp32 scale per 128x128 block, `W_deq[n, k] =
W[n, k] * Ws[n // 128, k // 128]`; an activation of e4m3 codes with one fp32 scale per row and
128-column group, `A_deq[m, k] = A[m, k] * As[m, k // 128]`.

The linear's activation quant (per row and 128-column group) is a discrete function, stated here in
the fp32 arithmetic it is defined in (sgl-kernel's `per_token_group_quant_8bit`, which the pinned
SGLang runs on CUDA): `amax = max(1e-10, max |x|)`, stored scale `amax * fp32(1/448)`, codes
`e4m3_rn(clamp(x * (448 / amax), -448, 448))` (IEEE fp32 ops, round-to-nearest-even cast).
"""

from __future__ import annotations

from typing import Tuple

import torch

FP8 = torch.float8_e4m3fn
GROUP = 128
FP8_MAX = 448.0


def quantize_activation_ref(x: torch.Tensor, group: int = GROUP) -> Tuple[torch.Tensor, torch.Tensor]:
    """[.., K] (K % group == 0) -> (e4m3 codes [.., K], fp32 scales [.., K / group]), bit for bit."""
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], shape[-1] // group, group)
    amax = xf.abs().amax(-1).clamp(min=torch.tensor(1e-10, dtype=torch.float32).item())
    mult = torch.full_like(amax, FP8_MAX) / amax
    q = (xf * mult.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(shape)
    scale = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    return q, scale


def dequant_weight(w: torch.Tensor, ws: torch.Tensor, block: Tuple[int, int] = (GROUP, GROUP)) -> torch.Tensor:
    n, k = w.shape
    s = ws.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w.double() * s


def dequant_activation(a: torch.Tensor, a_s: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    k = a.shape[-1]
    return a.double() * a_s.double().repeat_interleave(group, -1)[..., :k]
