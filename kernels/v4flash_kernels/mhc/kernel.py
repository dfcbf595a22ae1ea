"""Triton kernels of DeepSeek-V4's hyper-connection boundary (mHC): mix, finish, post.

A pre (or a fused post+pre) is two launches:

1. `mix_kernel`, grid `(token blocks, splits)`: each program owns a token block and a slice of the
   hidden dimension, *all four streams* of it. It reads the streams (fused: computes them from the
   previous post's inputs and writes them, bf16), multiplies them with its `[24, 4 x slice]` of
   `hc_fn` on the tensor cores and writes a `[tokens, 32]` partial of the 24 mixes. Splitting the
   hidden dimension spreads the 1.5 MB `hc_fn` read over the SMs when there are few tokens; at
   prefill sizes the token blocks do that. `hc_fn` is fp32 and the streams bf16: `hc_fn` is split
   exactly into three bf16 parts, so three bf16 MMAs give products exact in fp32 and fp32
   accumulation (fp32 GEMV accuracy at bf16 MMA rates).
2. `finish_kernel`, one program per token: requests the token's streams, base/scale and norm
   weight first (their latency hides under what follows), sums the partials in a fixed order,
   takes the RMS of the streams, the sigmoids, writes post, mixes the streams into y with the
   optional RMSNorm of the sub-layer, then runs the 20 Sinkhorn iterations on the 4x4 as 16
   scalars (no cross-thread traffic) and writes comb.

`post_kernel` is the post alone (`hc_post`): one program per (token, hidden block).

Deterministic: every sum has a fixed order and there are no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

MIX_PAD = tl.constexpr(32)  # the 24 mixes padded to an MMA width
MIX = tl.constexpr(24)


@triton.jit
def _bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> bf16 rounded to nearest even. Triton's CPU interpreter truncates instead, so there the
    rounding is spelled out on the bits (finite values), and CPU tests see a GPU's roundings."""
    if INTERPRET:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        x = b.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _post4(p0, p1, p2, p3,
           c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33,
           xin, r0, r1, r2, r3, INTERPRET: tl.constexpr):
    """The post's four new streams (bf16): new_j = post_j * x + sum_k comb[k, j] * residual_k."""
    v0 = p0 * xin + c00 * r0 + c10 * r1 + c20 * r2 + c30 * r3
    v1 = p1 * xin + c01 * r0 + c11 * r1 + c21 * r2 + c31 * r3
    v2 = p2 * xin + c02 * r0 + c12 * r1 + c22 * r2 + c32 * r3
    v3 = p3 * xin + c03 * r0 + c13 * r1 + c23 * r2 + c33 * r3
    return _bf16(v0, INTERPRET), _bf16(v1, INTERPRET), _bf16(v2, INTERPRET), _bf16(v3, INTERPRET)


@triton.jit
def _gemv_stream(acc, xb, FN_J, hh, hmask, o, omask, K: tl.constexpr, INTERPRET: tl.constexpr):
    """acc += xb @ hc_fn[:, slice]^T for one stream, as three exact bf16 parts.

    Under Triton's CPU interpreter (whose bf16 dot is wrong) the same three parts multiply as fp32.
    """
    f = tl.load(FN_J + o[:, None] * K + hh[None, :], mask=omask[:, None] & hmask[None, :], other=0.0)
    hi = _bf16(f, INTERPRET)
    rest = f - hi.to(tl.float32)
    mid = _bf16(rest, INTERPRET)
    lo = _bf16(rest - mid.to(tl.float32), INTERPRET)
    if not INTERPRET:
        acc = tl.dot(xb, tl.trans(lo), acc)
        acc = tl.dot(xb, tl.trans(mid), acc)
        acc = tl.dot(xb, tl.trans(hi), acc)
    else:
        xf = xb.to(tl.float32)
        acc = tl.dot(xf, tl.trans(lo.to(tl.float32)), acc, input_precision="ieee")
        acc = tl.dot(xf, tl.trans(mid.to(tl.float32)), acc, input_precision="ieee")
        acc = tl.dot(xf, tl.trans(hi.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def mix_kernel(
    X,  # [N, 4, H] bf16 contiguous: the streams (pre), or the previous streams (fused post+pre)
    XIN,  # fused: [N, H] bf16 sub-layer output
    POST_IN,  # fused: [N, 4] fp32
    COMB_IN,  # fused: [N, 4, 4] fp32
    R_OUT,  # fused: [N, 4, H] bf16 new streams
    FN,  # [24, 4H] fp32 contiguous
    PART,  # [splits, N, 32] fp32 partials
    n_tokens,
    h_per_split,  # a multiple of BLOCK_H
    H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FUSED: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = t < n_tokens
    o = tl.arange(0, MIX_PAD)
    omask = o < MIX
    acc = tl.zeros([BLOCK_T, MIX_PAD], dtype=tl.float32)
    if FUSED:
        pb = POST_IN + t * 4
        p0 = tl.load(pb + 0, mask=tmask, other=0.0)[:, None]
        p1 = tl.load(pb + 1, mask=tmask, other=0.0)[:, None]
        p2 = tl.load(pb + 2, mask=tmask, other=0.0)[:, None]
        p3 = tl.load(pb + 3, mask=tmask, other=0.0)[:, None]
        cb = COMB_IN + t * 16
        c00 = tl.load(cb + 0, mask=tmask, other=0.0)[:, None]
        c01 = tl.load(cb + 1, mask=tmask, other=0.0)[:, None]
        c02 = tl.load(cb + 2, mask=tmask, other=0.0)[:, None]
        c03 = tl.load(cb + 3, mask=tmask, other=0.0)[:, None]
        c10 = tl.load(cb + 4, mask=tmask, other=0.0)[:, None]
        c11 = tl.load(cb + 5, mask=tmask, other=0.0)[:, None]
        c12 = tl.load(cb + 6, mask=tmask, other=0.0)[:, None]
        c13 = tl.load(cb + 7, mask=tmask, other=0.0)[:, None]
        c20 = tl.load(cb + 8, mask=tmask, other=0.0)[:, None]
        c21 = tl.load(cb + 9, mask=tmask, other=0.0)[:, None]
        c22 = tl.load(cb + 10, mask=tmask, other=0.0)[:, None]
        c23 = tl.load(cb + 11, mask=tmask, other=0.0)[:, None]
        c30 = tl.load(cb + 12, mask=tmask, other=0.0)[:, None]
        c31 = tl.load(cb + 13, mask=tmask, other=0.0)[:, None]
        c32 = tl.load(cb + 14, mask=tmask, other=0.0)[:, None]
        c33 = tl.load(cb + 15, mask=tmask, other=0.0)[:, None]
    h_lo = pid_s * h_per_split
    for h0 in range(h_lo, h_lo + h_per_split, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hmask = hh < H
        m2 = tmask[:, None] & hmask[None, :]
        src = X + t[:, None] * (4 * H) + hh[None, :]
        if FUSED:
            xin = tl.load(XIN + t[:, None] * H + hh[None, :], mask=m2, other=0.0).to(tl.float32)
            r0 = tl.load(src, mask=m2, other=0.0).to(tl.float32)
            r1 = tl.load(src + H, mask=m2, other=0.0).to(tl.float32)
            r2 = tl.load(src + 2 * H, mask=m2, other=0.0).to(tl.float32)
            r3 = tl.load(src + 3 * H, mask=m2, other=0.0).to(tl.float32)
            v0, v1, v2, v3 = _post4(p0, p1, p2, p3, c00, c01, c02, c03, c10, c11, c12, c13,
                                    c20, c21, c22, c23, c30, c31, c32, c33, xin, r0, r1, r2, r3, INTERPRET)
            dst = R_OUT + t[:, None] * (4 * H) + hh[None, :]
            tl.store(dst, v0, mask=m2)
            tl.store(dst + H, v1, mask=m2)
            tl.store(dst + 2 * H, v2, mask=m2)
            tl.store(dst + 3 * H, v3, mask=m2)
        else:
            v0 = tl.load(src, mask=m2, other=0.0)
            v1 = tl.load(src + H, mask=m2, other=0.0)
            v2 = tl.load(src + 2 * H, mask=m2, other=0.0)
            v3 = tl.load(src + 3 * H, mask=m2, other=0.0)
        acc = _gemv_stream(acc, v0, FN, hh, hmask, o, omask, 4 * H, INTERPRET)
        acc = _gemv_stream(acc, v1, FN + H, hh, hmask, o, omask, 4 * H, INTERPRET)
        acc = _gemv_stream(acc, v2, FN + 2 * H, hh, hmask, o, omask, 4 * H, INTERPRET)
        acc = _gemv_stream(acc, v3, FN + 3 * H, hh, hmask, o, omask, 4 * H, INTERPRET)
    dst = PART + pid_s.to(tl.int64) * n_tokens * MIX_PAD + t[:, None] * MIX_PAD + o[None, :]
    tl.store(dst, acc, mask=tmask[:, None])


@triton.jit
def _softmax4(a, b, c, d, eps):
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a = tl.exp(a - m)
    b = tl.exp(b - m)
    c = tl.exp(c - m)
    d = tl.exp(d - m)
    s = a + b + c + d
    return a / s + eps, b / s + eps, c / s + eps, d / s + eps


@triton.jit
def _norm4(a, b, c, d, eps):
    s = a + b + c + d + eps
    return a / s, b / s, c / s, d / s


@triton.jit
def _sinkhorn(c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33,
              eps, ITERS: tl.constexpr):
    """Row softmax (+eps), column normalisation, then ITERS-1 row/column rounds; c[j, k] = cjk."""
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, eps)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, eps)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, eps)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, eps)
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    for _ in tl.static_range(ITERS - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    return c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33


@triton.jit
def finish_kernel(
    PART,  # [splits, N, 32] fp32 partials; split 0's row is overwritten with the sums
    n_tokens,
    n_splits,
    X,  # [N, 4, H] bf16: the streams y is mixed from
    SCALE,  # [3] fp32
    BASE,  # [24] fp32
    POST,  # [N, 4] fp32 out
    COMB,  # [N, 4, 4] fp32 out
    Y,  # [N, H] bf16 out
    NORM_W,  # [H] bf16 (HAS_NORM)
    rms_eps,
    pre_eps,
    sinkhorn_eps,
    post_mult,
    norm_eps,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    S_PAD: tl.constexpr,
    ITERS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < H
    o = tl.arange(0, MIX_PAD)
    # Everything that does not depend on the mixes is requested first: its latency (DRAM for the
    # weights of a layer not touched since the last step) overlaps the partials' reduction.
    src = X + t * (4 * H) + hh
    x0 = tl.load(src, mask=hmask, other=0.0)
    x1 = tl.load(src + H, mask=hmask, other=0.0)
    x2 = tl.load(src + 2 * H, mask=hmask, other=0.0)
    x3 = tl.load(src + 3 * H, mask=hmask, other=0.0)
    if HAS_NORM:
        w = tl.load(NORM_W + hh, mask=hmask, other=0.0).to(tl.float32)
    base = tl.load(BASE + o, mask=o < MIX, other=0.0)
    s0 = tl.load(SCALE)
    s1 = tl.load(SCALE + 1)
    s2 = tl.load(SCALE + 2)
    row = PART + t * MIX_PAD
    sp = tl.arange(0, S_PAD)
    part = tl.load(row + sp[:, None] * (n_tokens * MIX_PAD) + o[None, :], mask=(sp < n_splits)[:, None], other=0.0)
    total = tl.sum(part, axis=0)

    x0f = x0.to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    x3f = x3.to(tl.float32)
    rs = tl.rsqrt(tl.sum(x0f * x0f + x1f * x1f + x2f * x2f + x3f * x3f, axis=0) / (4 * H) + rms_eps)
    # The 24 arguments (mix * rs * scale + base): pre 0-3, post 4-7, comb 8-23 (c[j, k] at 8 + 4j + k).
    arg = total * rs * tl.where(o < 4, s0, tl.where(o < 8, s1, s2)) + base
    sig = tl.sigmoid(arg)
    act = tl.where(o < 4, sig + pre_eps, tl.where(o < 8, sig * post_mult, arg))
    tl.store(POST + t * 4 + (o - 4), act, mask=(o >= 4) & (o < 8))
    # pre and the comb logits are needed as scalars (no cross-thread traffic in what follows): through
    # split 0's row of the partials, which every thread has finished reading at the first barrier.
    tl.debug_barrier()
    tl.store(row + o, act)
    tl.debug_barrier()

    pre0 = tl.load(row + 0)
    pre1 = tl.load(row + 1)
    pre2 = tl.load(row + 2)
    pre3 = tl.load(row + 3)
    y = pre0 * x0f + pre1 * x1f + pre2 * x2f + pre3 * x3f
    yb = _bf16(y, INTERPRET)
    if HAS_NORM:
        yf = yb.to(tl.float32)
        inv = tl.rsqrt(tl.sum(yf * yf, axis=0) / H + norm_eps)
        yb = _bf16(yf * inv * w, INTERPRET)
    tl.store(Y + t * H + hh, yb, mask=hmask)

    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33 = _sinkhorn(
        tl.load(row + 8), tl.load(row + 9), tl.load(row + 10), tl.load(row + 11),
        tl.load(row + 12), tl.load(row + 13), tl.load(row + 14), tl.load(row + 15),
        tl.load(row + 16), tl.load(row + 17), tl.load(row + 18), tl.load(row + 19),
        tl.load(row + 20), tl.load(row + 21), tl.load(row + 22), tl.load(row + 23), sinkhorn_eps, ITERS)
    cb = COMB + t * 16
    tl.store(cb + 0, c00)
    tl.store(cb + 1, c01)
    tl.store(cb + 2, c02)
    tl.store(cb + 3, c03)
    tl.store(cb + 4, c10)
    tl.store(cb + 5, c11)
    tl.store(cb + 6, c12)
    tl.store(cb + 7, c13)
    tl.store(cb + 8, c20)
    tl.store(cb + 9, c21)
    tl.store(cb + 10, c22)
    tl.store(cb + 11, c23)
    tl.store(cb + 12, c30)
    tl.store(cb + 13, c31)
    tl.store(cb + 14, c32)
    tl.store(cb + 15, c33)


@triton.jit
def post_kernel(
    XIN,  # [N, H] bf16
    RES,  # [N, 4, H] bf16
    POST,  # [N, 4] fp32
    COMB,  # [N, 4, 4] fp32
    OUT,  # [N, 4, H] bf16
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = hh < H
    xin = tl.load(XIN + t * H + hh, mask=hmask, other=0.0).to(tl.float32)
    src = RES + t * (4 * H) + hh
    r0 = tl.load(src, mask=hmask, other=0.0).to(tl.float32)
    r1 = tl.load(src + H, mask=hmask, other=0.0).to(tl.float32)
    r2 = tl.load(src + 2 * H, mask=hmask, other=0.0).to(tl.float32)
    r3 = tl.load(src + 3 * H, mask=hmask, other=0.0).to(tl.float32)
    pb = POST + t * 4
    cb = COMB + t * 16
    v0, v1, v2, v3 = _post4(
        tl.load(pb), tl.load(pb + 1), tl.load(pb + 2), tl.load(pb + 3),
        tl.load(cb), tl.load(cb + 1), tl.load(cb + 2), tl.load(cb + 3),
        tl.load(cb + 4), tl.load(cb + 5), tl.load(cb + 6), tl.load(cb + 7),
        tl.load(cb + 8), tl.load(cb + 9), tl.load(cb + 10), tl.load(cb + 11),
        tl.load(cb + 12), tl.load(cb + 13), tl.load(cb + 14), tl.load(cb + 15),
        xin, r0, r1, r2, r3, INTERPRET)
    dst = OUT + t * (4 * H) + hh
    tl.store(dst, v0, mask=hmask)
    tl.store(dst + H, v1, mask=hmask)
    tl.store(dst + 2 * H, v2, mask=hmask)
    tl.store(dst + 3 * H, v3, mask=hmask)
