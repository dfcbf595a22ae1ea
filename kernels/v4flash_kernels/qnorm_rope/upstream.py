"""The unfused q path the fusion replaces, for the self-check, the tests and the bench: our block-FP8 linear,
then a torch statement of upstream's JIT `fused_q_norm_rope`.

Upstream's `fused_q_norm_rope` (sglang 0.5.13.post1, `jit_kernel/dsv4/elementwise.py` over
`jit_kernel/csrc/deepseek_v4/main_norm_rope.cuh`) is compiled by SGLang's CUDA JIT, which nothing
outside an SGLang worker can drive; `q_norm_rope` states what that kernel computes, step for step, in
torch (the same fp32 operations and bf16 rounding points; only the fp32 summation order of the
sum of squares and CUDA's approximate rsqrt differ): per (token, head) of the bf16 input,
`nf = rsqrt(sum(x^2) / 512 + eps)` in fp32, `y = bf16(x * nf)`; the last 64 dims' (even, odd) pairs
of y rotated in fp32 by `freqs_cis[position]` (fp32 cos/sin) and rounded to bf16, the others y.
"""

from __future__ import annotations

import torch

HEAD_DIM = 512


def q_norm_rope(q_input: torch.Tensor, q_output: torch.Tensor, eps: float, freqs_cis: torch.Tensor,
                positions: torch.Tensor) -> None:
    """`fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions)` in torch: q_input/q_output
    [B, H, 512] bf16, freqs_cis [P, rope/2] complex64, positions [B] int32/int64; writes q_output."""
    rope = freqs_cis.shape[-1] * 2
    x = q_input.float()
    nf = torch.rsqrt((x * x).sum(-1, keepdim=True) / q_input.shape[-1] + eps)
    y = (x * nf).to(q_input.dtype)
    f = torch.view_as_real(freqs_cis)[positions.to(torch.int32).long()].float()  # [B, rope/2, 2]
    c, s = f[:, None, :, 0], f[:, None, :, 1]
    re, im = y[..., -rope::2].float(), y[..., -rope + 1::2].float()
    out = y.clone()
    out[..., -rope::2] = (re * c - im * s).to(y.dtype)
    out[..., -rope + 1::2] = (re * s + im * c).to(y.dtype)
    q_output.copy_(out)


def unfused(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, n_heads: int, eps: float,
            freqs_cis: torch.Tensor, positions: torch.Tensor, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """What `MQALayer._compute_q_b` runs without the fusion when wq_b is our linear: our block-FP8 linear
    (`fp8_gemm`), then `q_norm_rope` into q_out (new when None); returns q_out."""
    from v4flash_kernels.fp8_gemm.op import w8a8_block_fp8_linear

    q = w8a8_block_fp8_linear(x, weight, [128, 128], weight_scale).view(-1, n_heads, HEAD_DIM)
    if q_out is None:
        q_out = torch.empty_like(q)
    q_norm_rope(q, q_out, eps, freqs_cis, positions)
    return q_out
