"""Triton kernels of DeepSeek-V4's hyper-connection boundary (mHC): mix (+ finish), finish, post.

`mix_kernel`, grid `(token blocks, splits)`: each program owns a token block and a slice of the
hidden dimension, *all four streams* of it. It requests its `[24, 4 x slice]` of `hc_fn` first (the
1.5 MB read is the boundary's only large one: every program's share is in flight at once), reads
the streams (fused: computes them from the previous post's inputs and writes them, bf16),
multiplies them with the `hc_fn` slice on the tensor cores and writes a `[tokens, 32]` partial of
the 24 mixes. Splitting the hidden dimension spreads `hc_fn` over the SMs when there are few
tokens; at prefill sizes the token blocks do that. `hc_fn` is fp32 and the streams bf16: `hc_fn` is
split exactly into three bf16 parts, so three bf16 MMAs give products exact in fp32 and fp32
accumulation (fp32 GEMV accuracy at bf16 MMA rates).

A decode boundary (`FINISH`) is that one launch: each program also writes its slice's sum of
squares of the streams (partial column 24), then takes an integer ticket on its token block; the
last program of the block to arrive (which one does not matter) sums the block's partials in split
order, so the result is deterministic, and finishes its tokens (`_finish_block`): the RMS, the
sigmoids, post, the 20 Sinkhorn rounds on the 4x4 (per token, elementwise over the block's tokens,
no cross-thread traffic), y mixed from the streams with the optional RMSNorm of the sub-layer, and
resets the ticket (graph replays need no reset kernel). No program waits for another.

A prefill boundary is two launches: the mix, then `finish_kernel`, one program per token (the
finish of a whole prefill chunk in the last programs would serialise it).

`post_kernel` is the post alone (`hc_post`): one program per (token, hidden block).

Deterministic: every sum has a fixed order and the only atomics are the integer tickets.
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
def _dot3(acc, xb, f, INTERPRET: tl.constexpr):
    """acc += xb @ f^T for one stream's `[32, BLOCK_H]` slice of hc_fn, as three exact bf16 parts.

    Under Triton's CPU interpreter (whose bf16 dot is wrong) the same three parts multiply as fp32.
    """
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
def _sq4(v0, v1, v2, v3):
    """Per-token sum of squares of four bf16 stream tiles `[BLOCK_T, BLOCK_H]` (fp32)."""
    a = v0.to(tl.float32)
    b = v1.to(tl.float32)
    c = v2.to(tl.float32)
    d = v3.to(tl.float32)
    return tl.sum(a * a + b * b + c * c + d * d, axis=1)


@triton.jit
def _fn_load(FN_J, hh, h_end, o, omask, H: tl.constexpr):
    """One stream's `[32, BLOCK_H]` slice of hc_fn (fp32; rows 24-31 zero), columns `hh` below `h_end`."""
    return tl.load(FN_J + o[:, None] * (4 * H) + hh[None, :], mask=omask[:, None] & (hh < h_end)[None, :], other=0.0)


@triton.jit
def _stream_loads(X, XIN, t, tmask, hh, h_end, H: tl.constexpr, FUSED: tl.constexpr):
    """One hidden tile's `[BLOCK_T, BLOCK_H]` bf16 inputs: the sub-layer output (fused; else a repeat
    of stream 0) and the four streams."""
    m2 = tmask[:, None] & (hh < h_end)[None, :]
    src = X + t[:, None] * (4 * H) + hh[None, :]
    r0 = tl.load(src, mask=m2, other=0.0)
    r1 = tl.load(src + H, mask=m2, other=0.0)
    r2 = tl.load(src + 2 * H, mask=m2, other=0.0)
    r3 = tl.load(src + 3 * H, mask=m2, other=0.0)
    if FUSED:
        xin = tl.load(XIN + t[:, None] * H + hh[None, :], mask=m2, other=0.0)
    else:
        xin = r0
    return xin, r0, r1, r2, r3


@triton.jit
def mix_kernel(
    X,  # [N, 4, H] bf16 contiguous: the streams (pre), or the previous streams (fused post+pre)
    XIN,  # fused: [N, H] bf16 sub-layer output
    POST_IN,  # fused: [N, 4] fp32
    COMB_IN,  # fused: [N, 4, 4] fp32
    R_OUT,  # fused: [N, 4, H] bf16 new streams
    FN,  # [24, 4H] fp32 contiguous
    PART,  # [splits, N, 32] fp32 partials
    CNT,  # FINISH: [token blocks] int32 tickets, zero between calls
    SCALE,  # FINISH: the outputs and parameters of `finish_kernel`
    BASE,
    POST,
    COMB,
    Y,
    NORM_W,
    n_tokens,
    h_per_split,  # a multiple of BLOCK_H
    rms_eps,
    pre_eps,
    sinkhorn_eps,
    post_mult,
    norm_eps,
    iters,
    H: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tile rows (>= 16, the MMA's M)
    TOKENS: tl.constexpr,  # tokens per block (<= BLOCK_T; FINISH: a power of two, may leave rows empty)
    BLOCK_H: tl.constexpr,
    FUSED: tl.constexpr,
    FINISH: tl.constexpr,
    BLOCK_HF: tl.constexpr,  # FINISH: next_power_of_2(H)
    HAS_NORM: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    t = (pid_t * TOKENS + rows).to(tl.int64)
    tmask = (rows < TOKENS) & (t < n_tokens)
    o = tl.arange(0, MIX_PAD)
    omask = o < MIX
    acc = tl.zeros([BLOCK_T, MIX_PAD], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
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
    h_end = tl.minimum(h_lo + h_per_split, H)
    hb = tl.arange(0, BLOCK_H)
    if FINISH:
        # Decode: every tile's requests go out a tile ahead (hc_fn first: the one read from DRAM),
        # before the previous tile's stores and MMAs.
        f0 = _fn_load(FN, h_lo + hb, h_end, o, omask, H)
        f1 = _fn_load(FN + H, h_lo + hb, h_end, o, omask, H)
        f2 = _fn_load(FN + 2 * H, h_lo + hb, h_end, o, omask, H)
        f3 = _fn_load(FN + 3 * H, h_lo + hb, h_end, o, omask, H)
        a0, a1, a2, a3, a4 = _stream_loads(X, XIN, t, tmask, h_lo + hb, h_end, H, FUSED)
    for h0 in range(h_lo, h_lo + h_per_split, BLOCK_H):
        hh = h0 + hb
        m2 = tmask[:, None] & (hh < H)[None, :]
        if FINISH:
            g0 = _fn_load(FN, hh + BLOCK_H, h_end, o, omask, H)
            g1 = _fn_load(FN + H, hh + BLOCK_H, h_end, o, omask, H)
            g2 = _fn_load(FN + 2 * H, hh + BLOCK_H, h_end, o, omask, H)
            g3 = _fn_load(FN + 3 * H, hh + BLOCK_H, h_end, o, omask, H)
            b0, b1, b2, b3, b4 = _stream_loads(X, XIN, t, tmask, hh + BLOCK_H, h_end, H, FUSED)
        else:
            a0, a1, a2, a3, a4 = _stream_loads(X, XIN, t, tmask, hh, h_end, H, FUSED)
        if FUSED:
            v0, v1, v2, v3 = _post4(p0, p1, p2, p3, c00, c01, c02, c03, c10, c11, c12, c13,
                                    c20, c21, c22, c23, c30, c31, c32, c33, a0.to(tl.float32), a1.to(tl.float32),
                                    a2.to(tl.float32), a3.to(tl.float32), a4.to(tl.float32), INTERPRET)
            dst = R_OUT + t[:, None] * (4 * H) + hh[None, :]
            tl.store(dst, v0, mask=m2)
            tl.store(dst + H, v1, mask=m2)
            tl.store(dst + 2 * H, v2, mask=m2)
            tl.store(dst + 3 * H, v3, mask=m2)
        else:
            v0, v1, v2, v3 = a1, a2, a3, a4
        if FINISH:
            acc = _dot3(acc, v0, f0, INTERPRET)
            acc = _dot3(acc, v1, f1, INTERPRET)
            acc = _dot3(acc, v2, f2, INTERPRET)
            acc = _dot3(acc, v3, f3, INTERPRET)
            sq += _sq4(v0, v1, v2, v3)
            f0, f1, f2, f3, a0, a1, a2, a3, a4 = g0, g1, g2, g3, b0, b1, b2, b3, b4
        else:
            # Prefill: one slice of hc_fn live at a time (the fused variant has no registers to spare).
            acc = _dot3(acc, v0, _fn_load(FN, hh, h_end, o, omask, H), INTERPRET)
            acc = _dot3(acc, v1, _fn_load(FN + H, hh, h_end, o, omask, H), INTERPRET)
            acc = _dot3(acc, v2, _fn_load(FN + 2 * H, hh, h_end, o, omask, H), INTERPRET)
            acc = _dot3(acc, v3, _fn_load(FN + 3 * H, hh, h_end, o, omask, H), INTERPRET)
    if FINISH:
        acc = tl.where(o[None, :] == MIX, sq[:, None], acc)
    dst = PART + pid_s.to(tl.int64) * n_tokens * MIX_PAD + t[:, None] * MIX_PAD + o[None, :]
    tl.store(dst, acc, mask=tmask[:, None])
    if FINISH:
        # The barrier orders every thread's stores (partials, streams) before the release; the
        # acquire and the finisher's .cg loads (past the non-coherent L1) make them visible to it.
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + pid_t, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            if FUSED:
                _finish_block(PART, n_tokens, tl.num_programs(1), R_OUT, SCALE, BASE, POST, COMB, Y, NORM_W,
                              pid_t, rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps, iters, H, TOKENS,
                              BLOCK_HF, HAS_NORM, INTERPRET)
            else:
                _finish_block(PART, n_tokens, tl.num_programs(1), X, SCALE, BASE, POST, COMB, Y, NORM_W,
                              pid_t, rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps, iters, H, TOKENS,
                              BLOCK_HF, HAS_NORM, INTERPRET)
            tl.atomic_xchg(CNT + pid_t, 0, sem="relaxed", scope="gpu")


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
              eps, iters):
    """Row softmax (+eps), column normalisation, then iters-1 row/column rounds; c[j, k] = cjk.

    A run-time loop: unrolled, its 20 rounds of divisions made every finishing kernel slow to compile."""
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, eps)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, eps)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, eps)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, eps)
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    for _ in range(0, iters - 1):
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
def _col(a, o, j: tl.constexpr):
    """Column j of a `[BLOCK_T, 32]` tile as a `[BLOCK_T]` vector (exact: the other terms are zeros)."""
    return tl.sum(tl.where(o[None, :] == j, a, 0.0), axis=1)


UNROLL_CHUNKS = tl.constexpr(16)  # partial chunks the finisher requests at once


@triton.jit
def _partials(PART, n_tokens, n_splits, sp, t, tmask, o):
    """`[TOKENS, 32]`: the sum over splits `sp` (masked past `n_splits`) of the block's partials."""
    ptr = PART + sp.to(tl.int64)[:, None, None] * (n_tokens * MIX_PAD) + t[None, :, None] * MIX_PAD + o[None, None, :]
    m = (sp < n_splits)[:, None, None] & tmask[None, :, None]
    return tl.sum(tl.load(ptr, mask=m, other=0.0, cache_modifier=".cg"), axis=0)


@triton.jit
def _finish_block(
    PART, n_tokens, n_splits, SRC, SCALE, BASE, POST, COMB, Y, NORM_W, tb,
    rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps, iters,
    H: tl.constexpr, TOKENS: tl.constexpr, BLOCK_HF: tl.constexpr, HAS_NORM: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The finish of token block `tb` once all its partials are in (the last program to arrive).

    Per token: the mixes and the streams' sum of squares are the partials summed in split order
    (up to 512 / TOKENS splits requested at once, any beyond in a loop); the split and the Sinkhorn
    run elementwise over the block's tokens; y is mixed one token at a time over the whole hidden
    dimension, the next token's streams (L2) and pre requested before this token's arithmetic.
    """
    t0 = tb.to(tl.int64) * TOKENS
    n_valid = tl.minimum(n_tokens - t0, TOKENS)
    rows = tl.arange(0, TOKENS)
    t = t0 + rows
    tmask = t < n_tokens
    o = tl.arange(0, MIX_PAD)
    hf = tl.arange(0, BLOCK_HF)
    hfm = hf < H
    # What does not depend on the partials is requested first: the first token's streams, the norm
    # weight and base/scale (DRAM for a layer's weights not touched since the last step).
    src = SRC + t0 * (4 * H) + hf
    x0 = tl.load(src, mask=hfm, other=0.0, cache_modifier=".cg")
    x1 = tl.load(src + H, mask=hfm, other=0.0, cache_modifier=".cg")
    x2 = tl.load(src + 2 * H, mask=hfm, other=0.0, cache_modifier=".cg")
    x3 = tl.load(src + 3 * H, mask=hfm, other=0.0, cache_modifier=".cg")
    if HAS_NORM:
        w = tl.load(NORM_W + hf, mask=hfm, other=0.0).to(tl.float32)
    base = tl.load(BASE + o, mask=o < MIX, other=0.0)
    s0 = tl.load(SCALE)
    s1 = tl.load(SCALE + 1)
    s2 = tl.load(SCALE + 2)
    CH: tl.constexpr = 32 // TOKENS  # splits per [CH, TOKENS, 32] chunk (1024 partials)
    sc = tl.arange(0, CH)
    total = tl.zeros([TOKENS, MIX_PAD], dtype=tl.float32)
    for k in tl.static_range(UNROLL_CHUNKS):
        total += _partials(PART, n_tokens, n_splits, k * CH + sc, t, tmask, o)
    for c0 in range(UNROLL_CHUNKS * CH, n_splits, CH):
        total += _partials(PART, n_tokens, n_splits, c0 + sc, t, tmask, o)

    rs = tl.rsqrt(_col(total, o, MIX) / (4 * H) + rms_eps)
    # The 24 arguments (mix * rs * scale + base): pre 0-3, post 4-7, comb 8-23 (c[j, k] at 8 + 4j + k).
    arg = total * rs[:, None] * tl.where(o < 4, s0, tl.where(o < 8, s1, s2))[None, :] + base[None, :]
    sig = tl.sigmoid(arg)
    act = tl.where(o < 4, sig + pre_eps, tl.where(o < 8, sig * post_mult, arg))
    tl.store(POST + t[:, None] * 4 + (o - 4)[None, :], act, mask=tmask[:, None] & ((o >= 4) & (o < 8))[None, :])

    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33 = _sinkhorn(
        _col(act, o, 8), _col(act, o, 9), _col(act, o, 10), _col(act, o, 11),
        _col(act, o, 12), _col(act, o, 13), _col(act, o, 14), _col(act, o, 15),
        _col(act, o, 16), _col(act, o, 17), _col(act, o, 18), _col(act, o, 19),
        _col(act, o, 20), _col(act, o, 21), _col(act, o, 22), _col(act, o, 23), sinkhorn_eps, iters)
    cb = COMB + t * 16
    tl.store(cb + 0, c00, mask=tmask)
    tl.store(cb + 1, c01, mask=tmask)
    tl.store(cb + 2, c02, mask=tmask)
    tl.store(cb + 3, c03, mask=tmask)
    tl.store(cb + 4, c10, mask=tmask)
    tl.store(cb + 5, c11, mask=tmask)
    tl.store(cb + 6, c12, mask=tmask)
    tl.store(cb + 7, c13, mask=tmask)
    tl.store(cb + 8, c20, mask=tmask)
    tl.store(cb + 9, c21, mask=tmask)
    tl.store(cb + 10, c22, mask=tmask)
    tl.store(cb + 11, c23, mask=tmask)
    tl.store(cb + 12, c30, mask=tmask)
    tl.store(cb + 13, c31, mask=tmask)
    tl.store(cb + 14, c32, mask=tmask)
    tl.store(cb + 15, c33, mask=tmask)

    # pre as scalars per token (no cross-thread traffic in the loop): through split 0's rows of the
    # partials, which every thread has finished reading at the first barrier.
    tl.debug_barrier()
    tl.store(PART + t[:, None] * MIX_PAD + o[None, :], act, mask=tmask[:, None])
    tl.debug_barrier()
    row = PART + t0 * MIX_PAD
    q0 = tl.load(row, cache_modifier=".cg")
    q1 = tl.load(row + 1, cache_modifier=".cg")
    q2 = tl.load(row + 2, cache_modifier=".cg")
    q3 = tl.load(row + 3, cache_modifier=".cg")
    for i in range(0, n_valid):
        ti = t0 + i
        more = i + 1 < n_valid
        nxt = SRC + (ti + 1) * (4 * H) + hf
        nm = hfm & more
        n0 = tl.load(nxt, mask=nm, other=0.0, cache_modifier=".cg")
        n1 = tl.load(nxt + H, mask=nm, other=0.0, cache_modifier=".cg")
        n2 = tl.load(nxt + 2 * H, mask=nm, other=0.0, cache_modifier=".cg")
        n3 = tl.load(nxt + 3 * H, mask=nm, other=0.0, cache_modifier=".cg")
        row = PART + (ti + 1) * MIX_PAD
        r0 = tl.load(row, mask=more, other=0.0, cache_modifier=".cg")
        r1 = tl.load(row + 1, mask=more, other=0.0, cache_modifier=".cg")
        r2 = tl.load(row + 2, mask=more, other=0.0, cache_modifier=".cg")
        r3 = tl.load(row + 3, mask=more, other=0.0, cache_modifier=".cg")
        y = q0 * x0.to(tl.float32) + q1 * x1.to(tl.float32) + q2 * x2.to(tl.float32) + q3 * x3.to(tl.float32)
        yb = _bf16(y, INTERPRET)
        if HAS_NORM:
            yf = yb.to(tl.float32)
            inv = tl.rsqrt(tl.sum(yf * yf, axis=0) / H + norm_eps)
            yb = _bf16(yf * inv * w, INTERPRET)
        tl.store(Y + ti * H + hf, yb, mask=hfm)
        x0, x1, x2, x3, q0, q1, q2, q3 = n0, n1, n2, n3, r0, r1, r2, r3


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
    iters,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    S_PAD: tl.constexpr,
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
        tl.load(row + 20), tl.load(row + 21), tl.load(row + 22), tl.load(row + 23), sinkhorn_eps, iters)
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
