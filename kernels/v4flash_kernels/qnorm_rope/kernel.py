"""Triton kernel of DeepSeek-V4's q path after `wq_b`: the block-FP8 GEMM, per-head RMSNorm, RoPE, one launch.

What it computes, for `M <= BM` rows (decode and speculative verify) and one attention head per
program (grid = the heads of this rank):

1. `q[m, h*512:(h+1)*512] = quant(x[m]) . dequant(W[h*512:(h+1)*512])^T` in `fp8_gemm`'s arithmetic:
   the activation quantized per row and 128-wide K group by `kit.e4m3.quant_groups` (the same
   e4m3 codes and scales, bit for bit, as the separate per-token-group quant and our fused GEMMs),
   e4m3 x e4m3 products on the tensor cores, each step's `(dot * a_scale) * w_scale` added to an fp32
   accumulator (as `gemm_kernel`'s swap-AB tile does per 128-wide group; here per BLOCK_K-wide step,
   so only the fp32 summation order differs), then rounded to bf16 as the linear's output is.
2. upstream's `fused_q_norm_rope` on that bf16 head (sglang 0.5.13.post1,
   `jit_kernel/csrc/deepseek_v4/main_norm_rope.cuh`, `fused_q_norm_rope`): RMSNorm without a weight,
   `y = bf16(x * rsqrt(sum(x^2) / 512 + eps))` in fp32 over the bf16 inputs, then RoPE on the last 64
   dims, whose (even, odd) pairs are (real, imaginary): `(re*c - im*s, re*s + im*c)` in fp32 from the
   bf16 `y` with `(c, s) = freqs[position]` (fp32, interleaved), rounded to bf16. The first 448 dims
   are `y`.
3. stored straight into `q_out[m, h, :]` (any row stride; heads 512 apart, dims contiguous), which at
   attention-TP > 1 is this rank's slice of the padded 64-head q.

Why one head per program: the norm needs the whole head's 512 outputs, so the program that owns them
finishes the head in registers (no partials, no atomics, no second launch). The price is that a few
programs (16 at TP4) stream the whole weight, 512 x K e4m3 each (512 KB at K = 1024): what sets the
time is the bytes each keeps in flight. So the weight streams through shared memory in [512, BLOCK_K]
tiles under Triton's software pipeline (`num_stages` - 1 tiles requested ahead with 16-byte
`cp.async`, no registers held for them), while the activation (16 x K) is loaded and quantized once,
up front, into registers; each step picks its [16, BLOCK_K] codes out of them exactly (as bit
patterns). The `fp8_gemm` GEMV's structure (the whole tile in one load, products on the CUDA cores)
does not scale to a 512-row tile: 16 rows x 512 x 1024 products and 512K e4m3 conversions per program
are microseconds of CUDA-core work; the MMA takes e4m3 directly, and rows 1..16 cost the same (the
activation side is padded to BM = 16, the MMA's smallest N).
"""

from __future__ import annotations

import triton
import triton.language as tl

from v4flash_kernels.kit.e4m3 import GROUP, quant_groups


@triton.jit
def qnorm_rope_kernel(
    X,  # [M, K] bf16 activation (wq_b's input, q_lora), contiguous; quantized here
    B,  # [H * HEAD_DIM, K] e4m3 weight, contiguous
    BS,  # [H * HEAD_DIM / 128, K / 128] fp32 weight scales, contiguous
    FREQ, stride_fp,  # [positions, ROPE] fp32: view_as_real(freqs_cis), (cos, sin) interleaved
    POS,  # [M] int32 / int64 positions
    OUT, stride_om,  # [M, H, HEAD_DIM] bf16, heads HEAD_DIM apart, dims contiguous
    M, eps,  # rows, the RMSNorm epsilon
    K: tl.constexpr,  # wq_b's input width (a multiple of 128): every weight/activation offset is a constant
    HEAD_DIM: tl.constexpr,
    ROPE: tl.constexpr,
    BM: tl.constexpr,  # rows block: 16 (the MMA's smallest N); rows M..BM-1 are zero and never stored
    BLOCK_K: tl.constexpr,  # K per pipelined step (divides 128): one [HEAD_DIM, BLOCK_K] weight tile
):
    """Grid (H,): program h computes head h of every row."""
    G: tl.constexpr = K // GROUP
    NK: tl.constexpr = K // BLOCK_K
    PER: tl.constexpr = GROUP // BLOCK_K  # steps per quant group
    h = tl.program_id(0)
    rm = tl.arange(0, BM)
    r_ok = rm < M

    # The whole activation quantized once (16 x 1024 values: registers), as e4m3 codes [BM, NK, BLOCK_K]
    # (bit patterns, so one step's can be picked out exactly) and scales [BM, G].
    kk = tl.arange(0, G)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    x = tl.load(X + rm[:, None, None] * K + kk, mask=r_ok[:, None, None], other=0.0)
    codes, a_s = quant_groups(x.to(tl.float32), 2)
    codes = tl.reshape(codes.to(tl.int8, bitcast=True), (BM, NK, BLOCK_K))
    steps = tl.arange(0, NK)[None, :, None]
    groups = tl.arange(0, G)[None, :]

    wrows = tl.arange(0, HEAD_DIM)
    w_ptrs = B + h.to(tl.int64) * (HEAD_DIM * K) + wrows[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    bs_ptrs = BS + (h * (HEAD_DIM // GROUP) + wrows // GROUP) * G
    acc = tl.zeros((HEAD_DIM, BM), dtype=tl.float32)
    for j in range(NK):  # software-pipelined by Triton (num_stages): the weight tiles stream through shared memory
        g = j // PER
        w = tl.load(w_ptrs + j * BLOCK_K)  # [HEAD_DIM, BLOCK_K] e4m3
        q = tl.sum(tl.where(steps == j, codes, 0), axis=1).to(tl.int8).to(tl.float8e4nv, bitcast=True)  # [BM, BLOCK_K]
        s = tl.sum(tl.where(groups == g, a_s, 0.0), axis=1)  # [BM]
        b_s = tl.load(bs_ptrs + g)  # [HEAD_DIM]: one weight scale per 128 rows
        # fp8_gemm's swap-AB step: (W . q^T) * a_scale * w_scale, added in fp32
        acc += tl.dot(w, tl.trans(q)) * s[None, :] * b_s[:, None]

    # The linear's bf16 output, then upstream's rmsnorm-self in fp32 over it.
    xq = acc.to(tl.bfloat16).to(tl.float32)  # [HEAD_DIM, BM]
    ss = tl.sum(xq * xq, axis=0)
    nf = tl.math.rsqrt(ss / HEAD_DIM + eps)
    y = (xq * nf[None, :]).to(tl.bfloat16).to(tl.float32)

    # RoPE on the last ROPE dims: pairs (2p, 2p+1) = (re, im) of the bf16 y; the others pass through.
    re, im = tl.split(tl.reshape(tl.trans(y), (BM, HEAD_DIM // 2, 2)))  # [BM, HEAD_DIM / 2]
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
    tl.store(OUT + rm.to(tl.int64)[:, None] * stride_om + h * HEAD_DIM + d[None, :], out, mask=r_ok[:, None])
