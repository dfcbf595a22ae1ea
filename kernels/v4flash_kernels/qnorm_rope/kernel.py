"""Triton kernel of DeepSeek-V4's q path after `wq_b`: the block-FP8 GEMM, per-head RMSNorm, RoPE, one launch.

What it computes, for `M <= BM` rows (decode and speculative verify) and one attention head per
program (grid = the heads of this rank):

1. `q[m, h*512:(h+1)*512] = quant(x[m]) . dequant(W[h*512:(h+1)*512])^T`, exactly the arithmetic of
   `fp8_gemm`'s swap-AB tile (`gemm_kernel` with `QUANT_A`, `SWAP`): each 128-wide K group of the
   activation is quantized with `fp8_gemm.kernel.quant_groups` (the same codes and scales, bit for
   bit, as the separate per-token-group quant), multiplied against the head's e4m3 weight rows on the
   tensor cores, and added to an fp32 accumulator as `(dot * a_scale) * w_scale`; then rounded to
   bf16, as the linear's output is.
2. upstream's `fused_q_norm_rope` on that bf16 head (sglang 0.5.13.post1,
   `jit_kernel/csrc/deepseek_v4/main_norm_rope.cuh`, `fused_q_norm_rope`): RMSNorm without a weight,
   `y = bf16(x * rsqrt(sum(x^2) / 512 + eps))` in fp32 over the bf16 inputs, then RoPE on the last 64
   dims, whose (even, odd) pairs are (real, imaginary): `(re*c - im*s, re*s + im*c)` in fp32 from the
   bf16 `y` with `(c, s) = freqs[position]` (fp32, interleaved), rounded to bf16. The first 448 dims
   are `y`.
3. stored straight into `q_out[m, h, :]` (any row and head stride; the dims contiguous), which at
   attention-TP > 1 is this rank's slice of the padded 64-head q.

Why one head per program: the norm needs the whole head's 512 outputs, so the program that owns them
finishes the head in registers (no partials, no atomics, no second launch). Its weight tile is
512 x K e4m3 (512 KB at K = 1024), streamed one 128-wide group at a time; `PREFETCH` groups are
requested ahead of the one being multiplied (loop-carried registers), so that many 64 KB tiles are in
flight while the tensor cores work. The `fp8_gemm` GEMV's structure (the whole tile in one load, the
products on the CUDA cores) does not scale to a 512-row tile: 16 rows x 512 x 1024 products and 512K
e4m3 conversions per program are microseconds of CUDA-core work; the MMA takes e4m3 directly, and
rows 1..16 cost the same (the activation side is padded to BM = 16, the MMA's smallest N).
"""

from __future__ import annotations

import triton
import triton.language as tl

from v4flash_kernels.fp8_gemm.kernel import GROUP, quant_groups


@triton.jit
def _weight_tile(w_ptrs, g, G):
    """Group g's [HEAD_DIM, 128] weight tile; past the last group nothing is read (zeros, never used)."""
    return tl.load(w_ptrs + g * GROUP, mask=g < G, other=0.0)


@triton.jit
def _group_product(acc, w, X, stride_xm, bs_ptrs, stride_bsk, rm, r_ok, g):
    """`acc += (W_g . quant(X_g)^T) * a_scale * w_scale` for group g: fp8_gemm's swap-AB step."""
    kk = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(X + rm[None, :] * stride_xm + kk[:, None], mask=r_ok[None, :], other=0.0)  # [128, BM]
    q, a_s = quant_groups(x.to(tl.float32), 0)
    b_s = tl.load(bs_ptrs + g * stride_bsk)  # [HEAD_DIM]: one weight scale per 128 rows
    return acc + tl.dot(w, q) * a_s[None, :] * b_s[:, None]


@triton.jit
def qnorm_rope_kernel(
    X, stride_xm,  # [M, K] bf16 activation (wq_b's input, q_lora), K contiguous; quantized here
    B, stride_bn,  # [H * HEAD_DIM, K] e4m3 weight (K contiguous)
    BS, stride_bsn, stride_bsk,  # [H * HEAD_DIM / 128, K / 128] fp32 weight scales
    FREQ, stride_fp,  # [positions, ROPE] fp32: view_as_real(freqs_cis), (cos, sin) interleaved
    POS,  # [M] int32 / int64 positions
    OUT, stride_om, stride_oh,  # [M, H, HEAD_DIM] bf16 (dims contiguous)
    M, G, eps,  # rows, K / 128, the RMSNorm epsilon
    HEAD_DIM: tl.constexpr,
    ROPE: tl.constexpr,
    BM: tl.constexpr,  # rows block: 16 (the MMA's smallest N); rows M..BM-1 are zero and never stored
    PREFETCH: tl.constexpr,  # weight groups requested ahead of the one multiplied: 0, 1 or 2
):
    """Grid (H,): program h computes head h of every row."""
    h = tl.program_id(0)
    wrows = h * HEAD_DIM + tl.arange(0, HEAD_DIM)
    w_ptrs = B + wrows.to(tl.int64)[:, None] * stride_bn + tl.arange(0, GROUP)[None, :]
    bs_ptrs = BS + (wrows // GROUP) * stride_bsn
    rm = tl.arange(0, BM)
    r_ok = rm < M
    acc = tl.zeros((HEAD_DIM, BM), dtype=tl.float32)

    if PREFETCH == 0:
        for g in range(G):
            acc = _group_product(acc, _weight_tile(w_ptrs, g, G), X, stride_xm, bs_ptrs, stride_bsk, rm, r_ok, g)
    elif PREFETCH == 1:
        w0 = _weight_tile(w_ptrs, 0, G)
        for g in range(G):
            w1 = _weight_tile(w_ptrs, g + 1, G)  # requested before this group's product waits on w0
            acc = _group_product(acc, w0, X, stride_xm, bs_ptrs, stride_bsk, rm, r_ok, g)
            w0 = w1
    else:
        w0 = _weight_tile(w_ptrs, 0, G)
        w1 = _weight_tile(w_ptrs, 1, G)
        for g in range(G):
            w2 = _weight_tile(w_ptrs, g + 2, G)
            acc = _group_product(acc, w0, X, stride_xm, bs_ptrs, stride_bsk, rm, r_ok, g)
            w0 = w1
            w1 = w2

    # The linear's bf16 output, then upstream's rmsnorm-self in fp32 over it.
    x = acc.to(tl.bfloat16).to(tl.float32)  # [HEAD_DIM, BM]
    ss = tl.sum(x * x, axis=0)
    nf = tl.math.rsqrt(ss / HEAD_DIM + eps)
    y = (x * nf[None, :]).to(tl.bfloat16).to(tl.float32)

    # RoPE on the last ROPE dims: pairs (2p, 2p+1) = (re, im) of the bf16 y; the others pass through.
    pairs = tl.reshape(tl.trans(y), (BM, HEAD_DIM // 2, 2))
    re, im = tl.split(pairs)  # [BM, HEAD_DIM / 2]
    NOPE_PAIRS: tl.constexpr = (HEAD_DIM - ROPE) // 2
    p = tl.arange(0, HEAD_DIM // 2)
    is_rope = (p >= NOPE_PAIRS)[None, :]
    pos = tl.load(POS + rm, mask=r_ok, other=0).to(tl.int32).to(tl.int64)  # upstream reads it as int32
    f_ptrs = FREQ + pos[:, None] * stride_fp + (2 * (p - NOPE_PAIRS))[None, :]
    f_ok = r_ok[:, None] & is_rope
    c = tl.load(f_ptrs, mask=f_ok, other=1.0)
    s = tl.load(f_ptrs + 1, mask=f_ok, other=0.0)
    o_re = tl.where(is_rope, re * c - im * s, re)
    o_im = tl.where(is_rope, re * s + im * c, im)
    out = tl.reshape(tl.join(o_re, o_im), (BM, HEAD_DIM)).to(OUT.dtype.element_ty)
    d = tl.arange(0, HEAD_DIM)
    tl.store(OUT + rm.to(tl.int64)[:, None] * stride_om + h * stride_oh + d[None, :], out, mask=r_ok[:, None])

