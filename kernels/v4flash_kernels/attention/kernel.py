"""Triton kernels for DeepSeek-V4 sparse-MLA decode over fp8_ds_mla paged caches.

One or two launches per call, no torch glue in between:

* ``split_kernel`` — grid ``(num_splits, head_blocks, B)``. Splits ``[0, S_A)`` walk chunks of the
  main (SWA) cache's top-k axis, splits ``[S_A, NS)`` chunks of the extra (c4/c128) cache, so one
  launch covers both caches and the GPU is filled even at B=1. Each program gathers and dequantizes
  a tile of ``BLOCK_T`` tokens once and shares it across ``BLOCK_H`` heads through two ``tl.dot``
  (heads are the MMA M dimension). Its ``EPILOGUE``: 0 writes the normalised partial output and its
  base-2 LSE for the combine kernel; 1 (grids small enough to be resident at once) also merges: the
  split programs of a row wait for each other on a self-resetting counter, then each merges a slice
  of the columns; 2 (one split per row) writes the final output directly.
* ``combine_kernel`` — grid ``(H, B)``, after EPILOGUE 0 only: merges every split of both caches by
  LSE, applies the attention sink and writes ``out`` (bf16) and ``lse`` (natural log, fp32).

Heads: q / out / lse / sink arrive as views of this call's head range (decode.run), and rows at or
past ``H`` are masked, so heads outside the range are never read or written.

Why the token is decoded as ``[BLOCK_T, 8, 64]``: the 512-wide latent is 7 fp8 groups of 64 (one
ue8m0 scale byte each) plus 64 bf16 RoPE values, i.e. exactly 8 groups of 64. A 3-D tile lets the
scale broadcast over its group for free and the RoPE group be selected with one ``where``; the
reshape to ``[BLOCK_T, 512]`` only feeds the dot operands, which go through shared memory anyway.
Dequantization is exact in bf16 (3 mantissa bits times a power of two), so the QK products are
exact; ``softmax_scale`` is applied in fp32 after the dot (rounding ``q*scale`` to bf16 costs ~1 %).

``DOT_DTYPE`` is the dot operand type: ``tl.float16`` for the shipped 16-head configs (fp8 -> fp16 is
exact and one instruction per two values; bounds in ``_dequant_tile``), ``tl.bfloat16`` for the wide
block; bf16 configs get ``tl.float32`` under ``TRITON_INTERPRET=1`` because the interpreter computes
bf16 arithmetic on raw bit patterns (fp16 is real numpy arithmetic there).

Only paths a shipped plan launches live here; the measured-and-dropped 16-head variants (register
prefetch of the next tile, the latent split across warps) are in kernels/scripts/attention_variants.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp8_ds_mla byte layout of one token (see docs/kernels.md).
TOKEN_DATA_BYTES = 576  # 448 fp8 NoPE + 64 bf16 RoPE
TOKEN_SCALE_BYTES = 8  # 7 ue8m0 scales + 1 pad, in the page's scale section
TOKEN_BYTES = 584
HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64

_CACHE_ARGS = ("W_A", "PS_A", "PB_A", "SI_A", "W_B", "PS_B", "PB_B", "SI_B")


@triton.jit
def _gather_tile(k8, ks64, kbf, idx, page_size, page_bytes, scale_section):
    """Issue the loads of one tile of tokens: fp8 NoPE [T,8,64], 8 scale bytes as one int64 [T], RoPE [T,1,64].

    Group 7 of the fp8 load reads the first 64 RoPE bytes (valid memory, discarded later) so the
    mask stays per-token and the loads stay 16-byte vectors.
    """
    valid = idx >= 0
    sidx = tl.where(valid, idx, 0)
    page = (sidx // page_size).to(tl.int64)
    slot = (sidx % page_size).to(tl.int64)
    base = tl.multiple_of(page * page_bytes + slot * 576, 16)  # token's data bytes
    sbase = (page * page_bytes + scale_section) // 8 + slot  # in int64 words
    rbase = tl.multiple_of(base // 2 + 224, 8)  # RoPE, in bf16 elements
    grp = tl.arange(0, 8)[None, :, None]
    col = tl.arange(0, 64)[None, None, :]
    v3 = valid[:, None, None]
    nope = tl.load(k8 + base[:, None, None] + grp * 64 + col, mask=v3, other=0.0)
    sc = tl.load(ks64 + sbase, mask=valid, other=0x7F7F7F7F7F7F7F7F)
    rope = tl.load(kbf + rbase[:, None, None] + col, mask=v3, other=0.0)
    return nope, sc, rope


@triton.jit
def _to_dot(x, DOT_DTYPE: tl.constexpr):
    """fp32 values -> the dot operand type; fp16 saturates at +-65504 instead of becoming inf."""
    if DOT_DTYPE == tl.float16:
        x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
    return x.to(DOT_DTYPE)


@triton.jit
def _dequant_tile(nope, sc, rope, BLOCK_T: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """[T,8,64] fp8 * 2^(scale-127) with group 7 replaced by RoPE -> [T, 512] in DOT_DTYPE (exact)."""
    grp = tl.arange(0, 8)[None, :, None]
    byte = ((sc[:, None, None] >> (grp.to(tl.int64) * 8)) & 0xFF).to(tl.int32)
    if DOT_DTYPE == tl.float16:
        # fp16 operands (fp8 -> fp16 is one instruction per two values, bf16 needs two more). Bounds:
        # the scale is kept inside fp16's range, 2^-24..2^15, and a dequantized value must stay
        # below 65504 (fp8 max 448 x scale <= 2^7). The model's KV latent is RMS-normalised: its
        # ue8m0 scales sit near 2^-8..2^0. q and RoPE values saturate at +-65504 (_to_dot).
        byte = tl.minimum(tl.maximum(byte, 103), 142)
    scale = (byte << 23).to(tl.float32, bitcast=True)  # 2^(byte-127)
    kv3 = tl.where(
        grp == 7,
        _to_dot(rope.to(tl.float32), DOT_DTYPE),
        nope.to(DOT_DTYPE) * scale.to(DOT_DTYPE),
    )
    return tl.reshape(kv3, [BLOCK_T, 512])


@triton.jit
def _tile_addr(ks64, idx, page_size, page_bytes, scale_section):
    """Per-token byte offset of the data, its 8 scale bytes (one int64) and validity, computed once per tile."""
    valid = idx >= 0
    sidx = tl.where(valid, idx, 0)
    page = (sidx // page_size).to(tl.int64)
    slot = (sidx % page_size).to(tl.int64)
    base = tl.multiple_of(page * page_bytes + slot * 576, 16)
    sc = tl.load(ks64 + (page * page_bytes + scale_section) // 8 + slot, mask=valid, other=0x7F7F7F7F7F7F7F7F)
    return base, sc, valid


@triton.jit
def _part_tile(k8, kbf, base, sc, valid, G0: tl.constexpr, NG: tl.constexpr, BLOCK_T: tl.constexpr,
               DOT_DTYPE: tl.constexpr):
    """Gather + dequantize latent groups [G0, G0+NG) of a tile -> [T, NG*64]; group 7 is RoPE.

    Written for the wide-block path, whose register budget is tight: the scale is applied in fp32
    (exact, like the bf16 product of `_dequant_tile`) and the RoPE group's fp8 bytes are not loaded;
    both choices are what made `h64_t32_w8_k4` compile without spills on sm_90 as well as sm_120.
    """
    grp = tl.arange(0, NG)[None, :, None] + G0
    col = tl.arange(0, 64)[None, None, :]
    v3 = valid[:, None, None]
    if G0 + NG == 8:
        nope = tl.load(k8 + base[:, None, None] + grp * 64 + col, mask=v3 & (grp < 7), other=0.0)
    else:
        nope = tl.load(k8 + base[:, None, None] + grp * 64 + col, mask=v3, other=0.0)
    byte = ((sc[:, None, None] >> (grp.to(tl.int64) * 8)) & 0xFF).to(tl.int32)
    scale = (byte << 23).to(tl.float32, bitcast=True)
    kv3 = (nope.to(tl.float32) * scale).to(DOT_DTYPE)
    if G0 + NG == 8:
        rbase = tl.multiple_of(base // 2 + 224, 8)
        rope = tl.load(kbf + rbase[:, None, None] + col, mask=v3, other=0.0)
        kv3 = tl.where(grp == 7, rope.to(tl.float32).to(DOT_DTYPE), kv3)
    return tl.reshape(kv3, [BLOCK_T, NG * 64])


@triton.jit
def _online_softmax_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr):
    """One tile: scores for all heads of the block (heads = MMA M), base-2 online softmax, P@V."""
    s = tl.dot(q, tl.trans(kv)) * qk_scale  # [BLOCK_H, BLOCK_T], log2 domain
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_CACHE_ARGS)
def split_kernel(
    Q,
    stride_qb,
    stride_qh,
    K8_A,  # float8_e4m3fn flat view of the main cache
    KS_A,  # int64 flat view (the 8 scale bytes of a token in one word)
    KBF_A,  # bfloat16 flat view (RoPE)
    IDX_A,  # int32 [B, W_A] (row stride SI_A)
    LEN_A,  # int32 [B] or dummy
    W_A,
    PS_A,  # page size (tokens)
    PB_A,  # page stride (bytes)
    SI_A,
    K8_B,
    KS_B,
    KBF_B,
    IDX_B,
    LEN_B,
    W_B,
    PS_B,
    PB_B,
    SI_B,
    WS_O,  # fp32 [B, H, NS, 512]
    WS_L,  # fp32 [B, H, NS] base-2 LSE
    H,
    S_A,
    NS,
    CHUNK,  # tokens per split, multiple of BLOCK_T
    qk_scale,  # softmax_scale * log2(e)
    OUT,  # bf16, row (b, h) at OUT + b*stride_ob + h*stride_oh (EPILOGUE 1 / 2)
    stride_ob,
    stride_oh,
    LSE,  # fp32, (b, h) at LSE + b*stride_lb + h
    stride_lb,
    SINK,  # fp32 [H] or dummy
    CNT,  # int32 [2 * B * head_blocks] arrival / departure counters, zero between calls (EPILOGUE 1)
    HAS_LEN_A: tl.constexpr,
    HAS_LEN_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    KSPLIT: tl.constexpr = 1,  # 4: the latent as four 128-wide parts (wide head blocks)
    EPILOGUE: tl.constexpr = 0,  # 0: partials only (combine_kernel merges); 1: cooperative merge; 2: NS == 1
    HAS_SINK: tl.constexpr = False,
    MERGE_SB: tl.constexpr = 16,  # splits per merge load (EPILOGUE 1)
    MERGE_COLS: tl.constexpr = 16,  # columns per merge slice (EPILOGUE 1)
):
    sid = tl.program_id(0)
    hb = tl.program_id(1)
    b = tl.program_id(2)

    # Pick the cache this split walks; both branches yield the same types.
    if sid < S_A:
        k8 = K8_A
        ks64 = KS_A
        kbf = KBF_A
        idx_row = IDX_A + b.to(tl.int64) * SI_A
        page_size = PS_A
        page_bytes = PB_A.to(tl.int64)
        n_valid = W_A
        if HAS_LEN_A:
            n_valid = tl.minimum(tl.load(LEN_A + b), W_A)
        split = sid
    else:
        k8 = K8_B
        ks64 = KS_B
        kbf = KBF_B
        idx_row = IDX_B + b.to(tl.int64) * SI_B
        page_size = PS_B
        page_bytes = PB_B.to(tl.int64)
        n_valid = W_B
        if HAS_LEN_B:
            n_valid = tl.minimum(tl.load(LEN_B + b), W_B)
        split = sid - S_A

    start = split * CHUNK
    end = tl.minimum(start + CHUNK, n_valid)
    scale_section = (page_size * 576).to(tl.int64)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = tl.arange(0, 512)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = _to_dot(tl.load(q_ptrs, mask=hmask[:, None], other=0.0).to(tl.float32), DOT_DTYPE)

    offs_t = tl.arange(0, BLOCK_T)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)

    t = start + offs_t
    idx = tl.load(idx_row + t, mask=t < end, other=-1)
    if KSPLIT == 4:
        # Wide head blocks (64 heads share each gathered token): the latent is walked as four
        # 128-wide parts with four accumulators, and q is re-read from L2 per part instead of being
        # held in registers across the loop, so only a quarter of the q / kv operand fragments are
        # live at once. Indices are loaded in the tile that uses them (no look-ahead): the
        # look-ahead made this config spill. Both are register-allocation choices checked by
        # check_sm120, not measured one by one.
        offs_d2 = tl.arange(0, 128)
        # Rows past H read head H-1 (in bounds, never stored): the q loads need no row mask.
        offs_hc = tl.minimum(offs_h, H - 1)
        q0_ptrs = Q + b.to(tl.int64) * stride_qb + offs_hc[:, None] * stride_qh + offs_d2[None, :]
        acc_0 = tl.zeros([BLOCK_H, 128], tl.float32)
        acc_1 = tl.zeros([BLOCK_H, 128], tl.float32)
        acc_2 = tl.zeros([BLOCK_H, 128], tl.float32)
        acc_3 = tl.zeros([BLOCK_H, 128], tl.float32)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + offs_t
            idx = tl.load(idx_row + t, mask=t < end, other=-1)
            base, sc, valid = _tile_addr(ks64, idx, page_size, page_bytes, scale_section)
            kv_0 = _part_tile(k8, kbf, base, sc, valid, 0, 2, BLOCK_T, DOT_DTYPE)
            kv_1 = _part_tile(k8, kbf, base, sc, valid, 2, 2, BLOCK_T, DOT_DTYPE)
            kv_2 = _part_tile(k8, kbf, base, sc, valid, 4, 2, BLOCK_T, DOT_DTYPE)
            kv_3 = _part_tile(k8, kbf, base, sc, valid, 6, 2, BLOCK_T, DOT_DTYPE)
            # Always true (t0 < end and offs_hc < H): a loop-variant mask so Triton's LICM
            # cannot hoist the q loads out of the loop (that would pin q in registers again).
            qm = (offs_hc[:, None] + t0) < end + H
            q_p = tl.load(q0_ptrs, mask=qm, other=0.0).to(tl.float32).to(DOT_DTYPE)
            s = tl.dot(q_p, tl.trans(kv_0))
            q_p = tl.load(q0_ptrs + 128, mask=qm, other=0.0).to(tl.float32).to(DOT_DTYPE)
            s = tl.dot(q_p, tl.trans(kv_1), acc=s)
            q_p = tl.load(q0_ptrs + 256, mask=qm, other=0.0).to(tl.float32).to(DOT_DTYPE)
            s = tl.dot(q_p, tl.trans(kv_2), acc=s)
            q_p = tl.load(q0_ptrs + 384, mask=qm, other=0.0).to(tl.float32).to(DOT_DTYPE)
            s = tl.dot(q_p, tl.trans(kv_3), acc=s) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            pd = p.to(DOT_DTYPE)
            acc_0 = tl.dot(pd, kv_0, acc=acc_0 * alpha[:, None])
            acc_1 = tl.dot(pd, kv_1, acc=acc_1 * alpha[:, None])
            acc_2 = tl.dot(pd, kv_2, acc=acc_2 * alpha[:, None])
            acc_3 = tl.dot(pd, kv_3, acc=acc_3 * alpha[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
    else:
        # Indices one tile ahead so the index->gather dependency overlaps the previous tile.
        for t0 in range(start, end, BLOCK_T):
            nope, sc, rope = _gather_tile(k8, ks64, kbf, idx, page_size, page_bytes, scale_section)
            valid = idx >= 0
            t = t0 + BLOCK_T + offs_t
            idx = tl.load(idx_row + t, mask=t < end, other=-1)
            kv = _dequant_tile(nope, sc, rope, BLOCK_T, DOT_DTYPE)
            m_i, l_i, acc = _online_softmax_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_DTYPE)

    has = l_i > 0.0
    lse2 = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if EPILOGUE == 2:
        # One split covers the row: finish here (sink, bf16 out, natural-log lse), no workspace.
        # (Never with KSPLIT == 4: see decode.epilogue_for.)
        lse_n, factor = _finish_scale(lse2, tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0), SINK, offs_h,
                                      hmask, HAS_SINK)
        o_row = OUT + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh
        tl.store(o_row + offs_d[None, :], (acc * factor[:, None]).to(tl.bfloat16), mask=hmask[:, None])
        tl.store(LSE + b.to(tl.int64) * stride_lb + offs_h, lse_n, mask=hmask)
    else:
        row = (b * H + offs_h).to(tl.int64) * NS + sid
        if KSPLIT == 4:
            inv = 1.0 / tl.where(has, l_i, 1.0)
            o_ptrs = WS_O + row[:, None] * 512 + offs_d2[None, :]
            tl.store(o_ptrs, acc_0 * inv[:, None], mask=hmask[:, None])
            tl.store(o_ptrs + 128, acc_1 * inv[:, None], mask=hmask[:, None])
            tl.store(o_ptrs + 256, acc_2 * inv[:, None], mask=hmask[:, None])
            tl.store(o_ptrs + 384, acc_3 * inv[:, None], mask=hmask[:, None])
        else:
            o = acc / tl.where(has, l_i, 1.0)[:, None]
            tl.store(WS_O + row[:, None] * 512 + offs_d[None, :], o, mask=hmask[:, None])
        tl.store(WS_L + row, lse2, mask=hmask)
        if EPILOGUE == 1:
            # Cooperative merge, no second launch: every split program of this (batch, head block)
            # announces its partial, waits until all NS have (the host only picks this when the
            # whole grid is resident at once, so the wait cannot starve), then merges its own
            # slices of the 512 columns. The barrier puts this CTA's partial stores before the
            # release; the acquire polls (and .cg loads, which skip the non-coherent L1) see the
            # others'. The last to leave zeroes both counters for the next call / graph replay.
            tl.debug_barrier()
            arr_ptr = CNT + 2 * (b * tl.num_programs(1) + hb)
            tl.atomic_add(arr_ptr, 1, sem="release", scope="gpu")
            seen = tl.atomic_add(arr_ptr, 0, sem="acquire", scope="gpu")
            while seen < NS:
                seen = tl.atomic_add(arr_ptr, 0, sem="acquire", scope="gpu")
            _merge_slices(WS_O, WS_L, (b * H + offs_h).to(tl.int64) * NS, hmask, NS, sid, OUT, stride_ob, stride_oh,
                          LSE, stride_lb, SINK, b, offs_h, HAS_SINK, BLOCK_H, MERGE_SB, MERGE_COLS)
            tl.debug_barrier()
            left = tl.atomic_add(arr_ptr + 1, 1, sem="acq_rel", scope="gpu")
            if left == NS - 1:
                tl.atomic_xchg(arr_ptr, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(arr_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _finish_scale(lse2, factor, SINK, offs_h, hmask, HAS_SINK: tl.constexpr):
    """Base-2 lse of the merged row and the output's scale -> (natural-log lse with the sink, scale)."""
    lse = lse2 * 0.6931471805599453  # -inf stays -inf
    if HAS_SINK:
        sink = tl.load(SINK + offs_h, mask=hmask, other=0.0)
        top = tl.maximum(lse, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        lse_f = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
        factor = factor * tl.where(lse == float("-inf"), 0.0, tl.exp(lse - lse_f))
        lse = lse_f
    return lse, factor


@triton.jit
def _merge_slices(WS_O, WS_L, row0, hmask, NS, sid, OUT, stride_ob, stride_oh, LSE, stride_lb, SINK, b, offs_h,
                  HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, MERGE_SB: tl.constexpr, MERGE_COLS: tl.constexpr):
    """Split program `sid`'s share of the merge: column slices sid, sid + NS, ... of BLOCK_H heads.

    One online pass per slice (running max, rescaled sums): a step's LSE and partial loads do not
    depend on each other or on the previous step, so NS <= MERGE_SB costs one L2 round trip. The
    program holding slice 0 writes the lse.
    """
    offs_s = tl.arange(0, MERGE_SB)
    offs_c = tl.arange(0, MERGE_COLS)
    o_row = OUT + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh
    for cb in range(sid, 512 // MERGE_COLS, NS):
        c0 = cb * MERGE_COLS
        acc = tl.zeros([BLOCK_H, MERGE_COLS], tl.float32)
        tot = tl.zeros([BLOCK_H], tl.float32)
        mx = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for s0 in range(0, NS, MERGE_SB):
            m2 = hmask[:, None] & ((s0 + offs_s) < NS)[None, :]
            lv = tl.load(WS_L + row0[:, None] + s0 + offs_s[None, :], mask=m2, other=float("-inf"),
                         cache_modifier=".cg")
            part = tl.load(
                WS_O + ((row0[:, None] + s0 + offs_s[None, :]) * 512)[:, :, None] + c0 + offs_c[None, None, :],
                mask=m2[:, :, None], other=0.0, cache_modifier=".cg",
            )
            m_new = tl.maximum(mx, tl.max(lv, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(mx - m_safe)  # 0 while nothing was seen (mx = -inf)
            w = tl.where(lv == float("-inf"), 0.0, tl.math.exp2(lv - m_safe[:, None]))  # [H, SB]
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, axis=1)
            tot = tot * alpha + tl.sum(w, axis=1)
            mx = m_new
        has = tot > 0.0
        safe_tot = tl.where(has, tot, 1.0)
        lse_n, factor = _finish_scale(tl.where(has, mx + tl.math.log2(safe_tot), float("-inf")),
                                      tl.where(has, 1.0 / safe_tot, 0.0), SINK, offs_h, hmask, HAS_SINK)
        tl.store(o_row + c0 + offs_c[None, :], (acc * factor[:, None]).to(tl.bfloat16), mask=hmask[:, None])
        if cb == 0:
            tl.store(LSE + b.to(tl.int64) * stride_lb + offs_h, lse_n, mask=hmask)


@triton.jit
def combine_kernel(
    WS_O,
    WS_L,
    OUT,  # bf16 [B, 1, H, 512]
    stride_ob,
    stride_oh,
    LSE,  # fp32, (b, h) at LSE + b*stride_lb + h
    stride_lb,
    SINK,  # fp32 [H] or dummy
    H,
    NS,
    HAS_SINK: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    row = b.to(tl.int64) * H + h
    offs_s = tl.arange(0, SPLIT_BLOCK)
    offs_d = tl.arange(0, 512)

    # One online pass (running max, rescaled sums): the LSE and partial loads of a block do not
    # depend on each other, so NS <= SPLIT_BLOCK costs a single L2 round trip.
    mv = tl.full([SPLIT_BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([512], tl.float32)
    tot = tl.zeros([SPLIT_BLOCK], tl.float32)
    for s0 in range(0, NS, SPLIT_BLOCK):
        smask = s0 + offs_s < NS
        lv = tl.load(WS_L + row * NS + s0 + offs_s, mask=smask, other=float("-inf"))
        part = tl.load(WS_O + (row * NS + s0 + offs_s)[:, None] * 512 + offs_d[None, :], mask=smask[:, None],
                       other=0.0)
        m_old = tl.max(mv, axis=0)
        mv = tl.maximum(mv, lv)
        m_new = tl.max(mv, axis=0)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_old - m_safe)  # 0 while nothing was seen
        w = tl.where(lv == float("-inf"), 0.0, tl.math.exp2(lv - m_safe))
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        tot = tot * alpha + w
    mx = tl.max(mv, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(tot, axis=0)
    has = total > 0.0
    safe_total = tl.where(has, total, 1.0)
    out = acc / safe_total
    lse = tl.where(has, (mx_safe + tl.math.log2(safe_total)) * 0.6931471805599453, float("-inf"))
    if HAS_SINK:
        sink = tl.load(SINK + h)
        top = tl.maximum(lse, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        lse_f = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
        out = out * tl.where(has, tl.exp(lse - lse_f), 0.0)
        lse = lse_f
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(tl.bfloat16))
    tl.store(LSE + b.to(tl.int64) * stride_lb + h, lse)
