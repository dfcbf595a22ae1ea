"""fp64 reference of the 128x128 block-scaled FP8 GEMM / linear, written from the format, and test inputs.

The format: a weight `W [N, K]` of e4m3 codes with one fp32 scale per 128x128 block, `W_deq[n, k] =
W[n, k] * Ws[n // 128, k // 128]`; an activation of e4m3 codes with one fp32 scale per row and
128-column group, `A_deq[m, k] = A[m, k] * As[m, k // 128]`; the product is `A_deq @ W_deq^T`,
evaluated here in fp64 (the kernels accumulate in fp32 and round once to the output dtype).

The linear's activation quant (per row and 128-column group) is a discrete function, stated here in
the fp32 arithmetic it is defined in (sgl-kernel's `per_token_group_quant_8bit`, which the pinned
SGLang runs on CUDA): `amax = max(1e-10, max |x|)`, stored scale `amax * fp32(1/448)`, codes
`e4m3_rn(clamp(x * (448 / amax), -448, 448))` (IEEE fp32 ops, round-to-nearest-even cast).
"""

from __future__ import annotations

import math
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


def excess_error(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rtol: float, atol_mag: float) -> float:
    """max over elements of |out - ref| / (rtol |ref| + atol_mag |.|-product): <= 1 passes.

    `rtol` covers the output dtype's rounding, `atol_mag` the fp32 accumulation (relative to the sum
    of absolute terms, so cancellation does not make a correct result look wrong)."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    bound = rtol * ref.abs() + atol_mag * mag + 1e-30
    return ((o - ref).abs() / bound).max().item() if o.numel() else 0.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(o - ref).item()
    return num / den if den > 0 else num


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
