"""fp64 reference of DeepSeek-V4's q path after wq_a, the error bound of its fp32/bf16 evaluation, test inputs.

From the definitions: `q = A_deq . W_deq^T` on the definition's quantized activation (`kit.fp8`: the
per-token 128-group e4m3 quant, 128x128-block weight scales); per (row, head) of 512 dims
`y = q / sqrt(mean(q^2) + eps)` (RMSNorm without a weight); RoPE on the last 64 dims, pair j = dims
(448 + 2j, 449 + 2j) = (re, im) rotated by `freqs_cis[position, j]` (complex multiply); the first 448
dims are y. No intermediate rounding.

`error_bound` is what an implementation that evaluates this in fp32 with bf16 roundings at upstream's
three points (the linear's output, the normalised head, the rotated pair) may differ by, element by
element; it is derived below from the operations, not fitted.
"""

from __future__ import annotations

import math
from typing import Tuple, cast

import torch

from v4flash_kernels.kit.fp8 import dequant_activation, dequant_weight, quantize_activation_ref

HEAD_DIM = 512
ROPE_DIM = 64
NOPE = HEAD_DIM - ROPE_DIM

# fp32 accumulation of the fp8 products relative to the sum of |terms|: on the GPU fp8_gemm's bound (the
# tensor cores add e4m3 products with fewer bits than fp32; measured equal for ours and upstream's GEMMs
# on the H200); in IEEE fp32 (the interpreter) a term's path through the sums (a dot of at most 128
# products, the per-step scaling, at most 16 step partials and 8 split-K partials) rounds fewer than
# 170 times: < 2^-16 of the |terms|.
ACC = 2.0 ** -10
ACC_IEEE = 2.0 ** -16
F32 = 2.0 ** -24
RSQRT = 2.0 ** -22  # rsqrt.approx.f32 (CUDA's rsqrtf, Triton's tl.math.rsqrt): < 2 ulp
BF16_RN = 2.0 ** -8  # round to nearest: half a bf16 ulp, relative
BF16_TRUNC = 2.0 ** -7  # Triton's interpreter truncates fp32 -> bf16: a whole ulp


def linear_ref(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, |A_deq| . |W_deq|^T) in fp64 on the definition's quantized activation, [M, N] each."""
    codes, scales = quantize_activation_ref(x)
    a = dequant_activation(codes, scales)
    wd = dequant_weight(w, ws)
    return a @ wd.t(), a.abs() @ wd.abs().t()


def _rope(y: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """y [M, H, 512] fp64 with the last 64 dims rotated by freqs [M, 32] complex (broadcast over heads)."""
    out = y.clone()
    re, im = y[..., NOPE::2], y[..., NOPE + 1::2]
    c, s = freqs.real.double()[:, None, :], freqs.imag.double()[:, None, :]
    out[..., NOPE::2] = re * c - im * s
    out[..., NOPE + 1::2] = re * s + im * c
    return out


def qnorm_rope_ref(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, n_heads: int, eps: float,
                   freqs_cis: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The q path, fp64 [M, n_heads, 512] (module doc)."""
    q, _ = linear_ref(x, w, ws)
    q = q.view(x.shape[0], n_heads, HEAD_DIM)
    y = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps)
    return _rope(y, freqs_cis[positions.long()])


def error_bound(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, n_heads: int, eps: float,
                freqs_cis: torch.Tensor, positions: torch.Tensor, bf16_unit: float = BF16_RN,
                acc: float = ACC) -> torch.Tensor:
    """Per element, how far an fp32 evaluation with upstream's bf16 roundings may be from `qnorm_rope_ref`.

    With u = `bf16_unit` and `acc` the accumulation's, per (row, head), q_i exact and M_i = sum |a||w|
    (the GEMM's |terms|):
    - linear: |q^_i - q_i| <= d_i = u |q_i| + (1 + u) acc M_i (fp32 accumulation, then bf16);
    - norm factor nf = (||q||^2 / 512 + eps)^-1/2 from the rounded head, summed in fp32 (relative
      512 * 2^-24): the radicand moves by at most t = (2 ||q|| ||d|| + ||d||^2 + 512 F32 (||q|| + ||d||)^2)
      / (||q||^2 + 512 eps), so nf by nu = (1 - t)^-1/2 - 1 + RSQRT;
    - y^_i = bf16(q^_i nf^): D_i = nf (d_i (1 + nu) + |q_i| nu) (1 + F32) + (u + F32) (|y_i| + nf (d_i (1 + nu) + |q_i| nu));
    - the first 448 dims: D_i; a rotated pair: |c| D_re + |s| D_im for the inputs, 3 F32 of the terms'
      magnitude for the fp32 products and sum, then u of the result's magnitude for its bf16 rounding.
    """
    m = x.shape[0]
    q, mag = linear_ref(x, w, ws)
    q, mag = q.view(m, n_heads, HEAD_DIM), mag.view(m, n_heads, HEAD_DIM)
    u = bf16_unit
    d = u * q.abs() + (1 + u) * acc * mag
    nq = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    nd = torch.linalg.vector_norm(d, dim=-1, keepdim=True)
    t = (2 * nq * nd + nd * nd + HEAD_DIM * F32 * (nq + nd) ** 2) / (nq * nq + HEAD_DIM * eps)
    if bool((t >= 1).any()):
        raise ValueError("error_bound: the head's norm is not determined to any relative accuracy (t >= 1)")
    nu = (1 - t) ** -0.5 - 1 + RSQRT
    nf = 1 / torch.sqrt((q * q).mean(-1, keepdim=True) + eps)
    y = q * nf
    pre = nf * (d * (1 + nu) + q.abs() * nu)
    dy = pre * (1 + F32) + (u + F32) * (y.abs() + pre)
    bound = dy.clone()
    f = freqs_cis[positions.long()]
    c, s = f.real.double().abs()[:, None, :], f.imag.double().abs()[:, None, :]
    yre, yim = y[..., NOPE::2].abs(), y[..., NOPE + 1::2].abs()
    dre, dim_ = dy[..., NOPE::2], dy[..., NOPE + 1::2]
    into = c * dre + s * dim_, s * dre + c * dim_
    terms = (yre * c + yim * s, yre * s + yim * c)  # |re c| + |im s| (and the imaginary part's)
    ref = _rope(y, f)
    for j, start in enumerate((NOPE, NOPE + 1)):
        rot = into[j] + 3 * F32 * (terms[j] + into[j])
        bound[..., start::2] = rot + u * (ref[..., start::2].abs() + rot)
    return cast(torch.Tensor, bound)


def excess(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    """max |out - ref| / bound over the elements (<= 1 passes; inf on a non-finite output)."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return ((o - ref).abs() / (bound + 1e-300)).max().item() if o.numel() else 0.0


# ----------------------------------------------------------------------------- inputs


def make_freqs_cis(positions: int, device: str = "cpu", base: float = 10000.0) -> torch.Tensor:
    """A complex64 [positions, 32] rotation table like DeepSeek-V4's (unit complex numbers at pos * theta_j)."""
    j = torch.arange(ROPE_DIM // 2, dtype=torch.float64, device=device)
    theta = base ** (-2 * j / ROPE_DIM)
    ang = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * theta[None, :]
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


def make_weight(n: int, k: int, gen: torch.Generator, device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 wq_b weight over the code range with per-block fp32 scales of a few magnitudes."""
    from v4flash_kernels.kit.fp8 import FP8, GROUP

    w = (torch.randn((n, k), generator=gen, device=device) * 64).clamp(-448, 448).to(FP8)
    ws = torch.rand((math.ceil(n / GROUP), math.ceil(k / GROUP)), generator=gen, device=device) * 2e-3 + 1e-4
    return w, ws


def make_activation(m: int, k: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """q_lora-like rows (RMS-normalised upstream, so O(1)) with the quant's edge cases: a zero group, a
    tiny group, an outlier."""
    x = torch.randn((m, k), generator=gen, device=device)
    if m and k >= 256:
        x[0, :128] = 0.0
        x[-1, 128:256] *= 1e-6
    if m and k:
        x[m // 2, k // 3] = 30.0
    return x.to(torch.bfloat16)


def make_positions(m: int, limit: int, gen: torch.Generator, device: str = "cpu",
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Positions for m rows below `limit`: the first 0, the last limit - 1, the rest random."""
    p = torch.randint(0, limit, (m,), generator=gen, device=device)
    if m:
        p[0] = 0
        p[-1] = limit - 1
    return p.to(dtype)
