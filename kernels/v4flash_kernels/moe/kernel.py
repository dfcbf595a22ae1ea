"""Triton kernels of the grouped MXFP4 MoE (DeepSeek-V4 routed experts) for sm_120 (and sm_90).

A call is two grouped GEMMs plus a per-token sum, no torch glue in between:

* routing: slots (token, k) are grouped by expert. Small calls (decode) group *inline*: program j
  of a GEMM owns slot j's expert if j is that expert's first slot, finds the expert's other slots
  with an O(slots) scan and exits otherwise. Large calls (prefill) run three small prep kernels
  (`hist_kernel`, `scan_kernel`, `scatter_kernel`) that sort slots by expert into blocks of
  `BLOCK_M` rows (a stable counting sort: deterministic, no atomics). Both are graph-safe: buffers
  and grids depend on shapes only, programs past the real work exit early.
* ``gemm_kernel`` GATED (w13): one program = one expert's row block x ``BLOCK_N`` gate columns and
  the matching ``BLOCK_N`` up columns (w13 rows ``n`` and ``I + n``, interleaved so one ``tl.dot``
  computes both), fused clamp + ``silu(gate) * up`` epilogue, writes bf16 ``[slots, I]``.
* ``gemm_kernel`` not GATED (w2): same tiling over the hidden axis, top-k weight x
  ``routed_scaling_factor`` fused, writes the weighted slot row (bf16) ``[slots, K]``.
* ``combine_kernel``: sums each token's valid slot rows in fixed order (deterministic) and casts.

FP4 decode (why the bit tricks): one packed byte holds two e2m1 values. Placing each nibble's sign
at bf16 bit 15 and its 3 exponent/mantissa bits at bf16 bits 8..6 gives a bf16 whose value is
``e2m1 * 2^-126`` *exactly* (e=0 lands in the subnormal range, which is what makes 0.5 come out
right). Both values of a byte are built in one 32-bit word with two integer multiplies and masks.
How the scale is applied depends on ``SCALE_MODE`` (a constexpr; the host picks it from the scale
tensor and the weight layout):

* ``SCALE_FAST`` (e8m0 bytes checked at load time to lie in ``[FAST_MIN_BYTE, FAST_MAX_BYTE]``,
  i.e. scales ``2^-62 .. 2^64``): one ``mul.rn.bf16x2`` by ``2^(byte - 64)`` finishes both values
  of a byte (bf16 multiplies keep subnormal inputs); the missing ``2^63`` is applied to the fp32
  accumulator in the epilogue. Exact inside that range, wrong outside it, so only layers whose
  every scale was range-checked (``moe.repack``) take it.
* ``SCALE_F32`` (any fp32 value) and ``SCALE_E8M0`` (any e8m0 byte, incl. 2^-127 and NaN): the
  e2m1 pair is made exact in bf16 (``* 2^126``), widened to fp32 and multiplied by the fp32 scale;
  each weight is that fp32 product rounded once to the dot operand type (exact for power-of-two
  scales; upstream multiplies in fp32 too). This is what the drop-in runs for its inputs: an fp32
  scale that is not a power of two must not be read by its exponent alone.

``NIBBLES=1`` (layers repacked at load time, `moe.repack`): W is read as int32 ``PAIR_SPLIT`` words
and decoded into k order with v2's word decode (`pairsplit.decode_word_groups`), so the activation
tile is contracted as loaded; the loader's byte order (``NIBBLES=0``) splits the activation into
its even and odd columns instead. Permuting the activation to match the words was tried first: its
shared-memory reads became 2-byte loads and the prefill GEMMs twice as slow on the H200.

``DEQ_ASM`` is True on the GPU; under ``TRITON_INTERPRET=1`` (no inline asm) the same bit pattern
is widened to fp32 and multiplied there, and ``DOT_DTYPE`` is fp32 (the interpreter computes bf16
on raw bits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from v4flash_kernels.moe.pairsplit import decode_word_groups

SHIFT = tl.constexpr(9.223372036854775808e18)  # 2^63: the accumulator factor SCALE_FAST leaves out
TWO_126 = tl.constexpr(8.507059173023462e37)  # 2^126: makes the e2m1 bit pattern its exact value

# Scale modes (constexpr SCALE_MODE of every GEMM kernel).
SCALE_FAST = 0  # e8m0 bytes in [FAST_MIN_BYTE, FAST_MAX_BYTE] (checked by the caller), exponent-only
SCALE_F32 = 1  # fp32 scales, any value
SCALE_E8M0 = 2  # e8m0 bytes, any value (0 = 2^-127, 255 = NaN)
FAST_MIN_BYTE = 65  # 2^-62: smallest e8m0 byte SCALE_FAST decodes exactly (bf16 products stay normal)
FAST_MAX_BYTE = 191  # 2^64: largest (the bf16 multiplier 2^(byte - 64) stays finite)


@triton.jit
def _e2m1_pair_bits(p):
    """uint8 byte(s) -> int32 word holding bf16 bits of (low nibble, high nibble) * 2^-126."""
    w = p.to(tl.int32)
    em = (w * 0x40040) & 0x01C001C0  # nibble bits 0-2 -> 6-8, bits 4-6 -> 22-24
    sg = (w * 0x1001000) & -2147450880  # 0x80008000: bit 3 -> 15, bit 7 -> 31
    return em | sg


@triton.jit
def _e8m0_value(b):
    """e8m0 byte(s) -> fp32 2^(b - 127) exactly: 0 is the subnormal 2^-127, 255 is NaN."""
    b = b.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant(packed, sc, SCALE_MODE: tl.constexpr, DEQ_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """packed [R, G, 16] uint8, sc [R, G] scales (uint8 bytes or fp32) -> (even, odd) [R, G, 16].

    SCALE_FAST: the values times 2^-63 (the caller multiplies its fp32 accumulator by SHIFT);
    otherwise the exact values fp32(e2m1) * fp32(scale), rounded once to DOT_DTYPE.
    """
    word = _e2m1_pair_bits(packed)
    if SCALE_MODE == 0:
        mexp = sc.to(tl.int32)[:, :, None] + 63  # bf16/fp32 exponent field of 2^(byte - 64)
        if DEQ_ASM:
            mword = (mexp << 7) | (mexp << 23)
            lo, hi = tl.inline_asm_elementwise(
                asm="{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
                constraints="=h,=h,r,r",
                args=[word, mword],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=1,
            )
            return lo.to(DOT_DTYPE), hi.to(DOT_DTYPE)
        else:
            mult = (mexp << 23).to(tl.float32, bitcast=True)
            lo = (word << 16).to(tl.float32, bitcast=True) * mult
            hi = (word & -65536).to(tl.float32, bitcast=True) * mult
            return lo.to(DOT_DTYPE), hi.to(DOT_DTYPE)
    else:
        if SCALE_MODE == 1:
            s = sc.to(tl.float32)[:, :, None]
        else:
            s = _e8m0_value(sc)[:, :, None]
        if DEQ_ASM:  # bf16 multiply by 2^126 (exact, keeps the subnormal 0.5), then widen
            lo16, hi16 = tl.inline_asm_elementwise(
                asm="{ .reg .b32 t, c; mov.b32 c, 0x7E807E80; mul.rn.bf16x2 t, $2, c; mov.b32 {$0, $1}, t; }",
                constraints="=h,=h,r",
                args=[word],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=1,
            )
            lo = lo16.to(tl.float32)
            hi = hi16.to(tl.float32)
        else:
            lo = (word << 16).to(tl.float32, bitcast=True) * TWO_126
            hi = (word & -65536).to(tl.float32, bitcast=True) * TWO_126
        return (lo * s).to(DOT_DTYPE), (hi * s).to(DOT_DTYPE)


@triton.jit
def swiglu(gate, up, clamp_limit, HAS_CLAMP: tl.constexpr):
    """upstream's activation: gate clamped above, up clamped both ways, silu(gate) * up (fp32)."""
    if HAS_CLAMP:
        gate = tl.minimum(gate, clamp_limit)
        up = tl.minimum(tl.maximum(up, -clamp_limit), clamp_limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def gemm_kernel(
    A,  # GATED: hidden [M, KD] (row = slot // A_DIV); else intermediate [S, KD] (row = slot)
    stride_am,
    W,  # uint8 [E, NW_TOTAL, KD/2], last dim contiguous
    stride_we,
    stride_wn,
    SC,  # scales [E, NW_TOTAL, KD/32] fp32 or uint8 e8m0 bytes (SCALE_MODE), last dim contiguous
    stride_se,
    stride_sn,
    OUT,  # GATED: [S, N] bf16; else [S, N] weighted slot rows
    stride_om,
    IDS,  # int32 [S] flat topk_ids (-1 = skip)
    TW,  # topk weights [S] (not GATED)
    SORTED,  # int32 [NB * BLOCK_M] slot of each sorted row (not INLINE)
    BLK_E,  # int32 [NB] expert of each row block, -1 past the end (not INLINE)
    BLK_R,  # int32 [NB] valid rows of each block (not INLINE)
    S,  # slots = M * topk
    N,  # output columns (I for GATED, hidden for w2)
    KD,  # reduction length
    A_DIV,  # topk for GATED (A row = token), 1 for w2
    clamp_limit,
    out_scale,  # routed_scaling_factor (1.0 when None)
    GATED: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    INLINE: tl.constexpr,
    BLOCK_S: tl.constexpr,  # power of two >= S (INLINE)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DEQ_ASM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    stride_ap=0,  # elements between split-K partial planes (SPLIT_K > 1 output / A_PARTS > 0 input)
    SPLIT_K: tl.constexpr = 1,  # GATED only: K split over grid axis 2, raw partials out, no activation
    A_PARTS: tl.constexpr = 0,  # w2 only: A is GEMM1's A_PARTS partial planes, reduced and activated here
    MODE: tl.constexpr = 0,  # 0: tl.dot(x, w^T); 1: tl.dot(w, x^T) (w in the left operand); 2: FMA; 3: FMA + prefetch
    NIBBLES: tl.constexpr = 0,  # W: 0 bytes in the loader's nibble order; 1 int32 repack.PAIR_SPLIT words
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)

    if INLINE:
        e = tl.load(IDS + pid_b)
        offs_s = tl.arange(0, BLOCK_S)
        ids = tl.load(IDS + offs_s, mask=offs_s < S, other=-1)
        match = ids == e
        earlier = tl.sum((match & (offs_s < pid_b)).to(tl.int32), axis=0)
        count = tl.sum(match.to(tl.int32), axis=0)
        rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
        n_chunks = tl.where((e >= 0) & (earlier == 0), tl.cdiv(count, BLOCK_M), 0)
    else:
        e = tl.load(BLK_E + pid_b)
        count = tl.load(BLK_R + pid_b)
        n_chunks = tl.where(e >= 0, 1, 0)
    e64 = tl.maximum(e, 0).to(tl.int64)

    NW: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    offs_w = tl.arange(0, NW)
    if GATED:
        col = pid_n * BLOCK_N + offs_w // 2
        wrow = (offs_w % 2) * N + col  # gate row n, up row I + n, interleaved
    else:
        col = pid_n * BLOCK_N + offs_w
        wrow = col
    w_ok = col < N
    G: tl.constexpr = BLOCK_K // 32
    offs_g = tl.arange(0, G)
    if NIBBLES == 1:  # int32 PAIR_SPLIT words [NW, G, 4], decoded into k order (pairsplit)
        tl.static_assert(SCALE_MODE == 0 and MODE <= 1, "PAIR_SPLIT words: fast scales, tensor-core modes")
    W_PER_K: tl.constexpr = 8 if NIBBLES == 1 else 2  # k per loaded element: words, or bytes [NW, G, 16]
    W_GROUP: tl.constexpr = 32 // W_PER_K  # elements per 32-weight scale group
    w_base = W + e64 * stride_we + wrow.to(tl.int64)[:, None, None] * stride_wn \
        + offs_g[None, :, None] * W_GROUP + tl.arange(0, W_GROUP)[None, None, :]
    s_base = SC + e64 * stride_se + wrow.to(tl.int64)[:, None] * stride_sn + offs_g[None, :]
    offs_k = tl.arange(0, BLOCK_K)

    for c in range(0, n_chunks):
        if INLINE:
            hit = match[None, :] & (rank[None, :] == (c * BLOCK_M + offs_m)[:, None])
            slot = tl.sum(tl.where(hit, offs_s[None, :], 0), axis=1)
            row_ok = (c * BLOCK_M + offs_m) < count
        else:
            row_ok = offs_m < count
            slot = tl.load(SORTED + pid_b * BLOCK_M + offs_m, mask=row_ok, other=0)
        a_row = (slot // A_DIV).to(tl.int64)
        a_ptr = A + a_row[:, None] * stride_am + offs_k[None, :]
        if MODE >= 2:  # FMA: products accumulated elementwise, one reduction after the loop
            acc3 = tl.zeros([BLOCK_M, NW, BLOCK_K // 2], dtype=tl.float32)
        elif MODE == 1:  # W is the MMA's left operand: acc^T [NW, BLOCK_M]
            acc_t = tl.zeros([NW, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, NW], dtype=tl.float32)
        k_lo = pid_k * (KD // SPLIT_K)
        k_hi = k_lo + KD // SPLIT_K
        if MODE == 3:  # FMA with the next W tile's bytes and scales loaded one step ahead
            packed_nx = tl.load(w_base + k_lo // W_PER_K, mask=w_ok[:, None, None], other=0)
            sc_nx = tl.load(s_base + k_lo // 32, mask=w_ok[:, None], other=0)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if MODE == 3:
                packed, sc = packed_nx, sc_nx
                more = (k0 + BLOCK_K) < k_hi
                packed_nx = tl.load(w_base + (k0 + BLOCK_K) // W_PER_K, mask=w_ok[:, None, None] & more, other=0)
                sc_nx = tl.load(s_base + (k0 + BLOCK_K) // 32, mask=w_ok[:, None] & more, other=0)
            else:
                packed = tl.load(w_base + k0 // W_PER_K, mask=w_ok[:, None, None], other=0)
                sc = tl.load(s_base + k0 // 32, mask=w_ok[:, None], other=0)
            if A_PARTS > 0:  # A = the split-K partial gate/up sums of GEMM1: reduce, activate
                g = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
                u = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
                for p in tl.static_range(A_PARTS):
                    g += tl.load(a_ptr + p * stride_ap + k0, mask=row_ok[:, None], other=0.0)
                    u += tl.load(a_ptr + p * stride_ap + KD + k0, mask=row_ok[:, None], other=0.0)
                a = swiglu(g, u, clamp_limit, HAS_CLAMP).to(tl.bfloat16)
            else:
                a = tl.load(a_ptr + k0, mask=row_ok[:, None], other=0.0)
            if NIBBLES == 1:  # W decoded into k order: one dot against the activation as loaded
                w = decode_word_groups(packed, sc, NW, BLOCK_K, DEQ_ASM, DOT_DTYPE)
                if MODE == 1:
                    acc_t = tl.dot(w, tl.trans(a.to(DOT_DTYPE)), acc_t)
                else:
                    acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w), acc)
            else:  # the loader's order: byte j holds k 2j (low nibble) and 2j + 1
                if MODE >= 2:
                    a = a.to(tl.float32)
                else:
                    a = a.to(DOT_DTYPE)
                a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
                if MODE >= 2:
                    lo, hi = _dequant(packed, sc, SCALE_MODE, DEQ_ASM, tl.float32)
                    lo = tl.reshape(lo, [NW, BLOCK_K // 2])
                    hi = tl.reshape(hi, [NW, BLOCK_K // 2])
                    acc3 += a_even[:, None, :] * lo[None, :, :] + a_odd[:, None, :] * hi[None, :, :]
                else:
                    lo, hi = _dequant(packed, sc, SCALE_MODE, DEQ_ASM, DOT_DTYPE)
                    lo = tl.reshape(lo, [NW, BLOCK_K // 2])
                    hi = tl.reshape(hi, [NW, BLOCK_K // 2])
                    if MODE == 1:
                        acc_t = tl.dot(lo, tl.trans(a_even), acc_t)
                        acc_t = tl.dot(hi, tl.trans(a_odd), acc_t)
                    else:
                        acc = tl.dot(a_even, tl.trans(lo), acc)
                        acc = tl.dot(a_odd, tl.trans(hi), acc)
        ACC_SCALE: tl.constexpr = SHIFT if SCALE_MODE == 0 else 1.0
        if MODE >= 2:
            acc = tl.sum(acc3, axis=2) * ACC_SCALE
        elif MODE == 1:
            acc = tl.trans(acc_t) * ACC_SCALE
        else:
            acc = acc * ACC_SCALE
        if GATED:
            gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
            ocol = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            o_ok = row_ok[:, None] & (ocol < N)[None, :]
            if SPLIT_K > 1:  # raw fp32 partials [SPLIT_K, S, 2N]: gate at col, up at N + col
                optr = OUT + pid_k * stride_ap + slot.to(tl.int64)[:, None] * stride_om + ocol[None, :]
                tl.store(optr, gate, mask=o_ok)
                tl.store(optr + N, up, mask=o_ok)
            else:
                h = swiglu(gate, up, clamp_limit, HAS_CLAMP)
                optr = OUT + slot.to(tl.int64)[:, None] * stride_om + ocol[None, :]
                tl.store(optr, h.to(OUT.dtype.element_ty), mask=o_ok)
        else:
            tw = tl.load(TW + slot, mask=row_ok, other=0.0).to(tl.float32) * out_scale
            optr = OUT + slot.to(tl.int64)[:, None] * stride_om + col[None, :]
            tl.store(optr, (acc * tw[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None] & w_ok[None, :])


@triton.jit
def combine_kernel(DOWN, IDS, OUT, stride_om, K, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum of token t's valid weighted slot rows, in slot order (fp32), cast to OUT's dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < K
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        e = tl.load(IDS + t * TOPK + k)
        acc += tl.load(DOWN + (t * TOPK + k) * K + offs, mask=ok & (e >= 0), other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_om + offs, acc.to(OUT.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- routing prep (large calls)


@triton.jit
def hist_kernel(IDS, HIST, RANK, S, E, CHUNK: tl.constexpr, E_P2: tl.constexpr):
    """Per chunk of CHUNK slots: histogram of experts -> HIST[chunk, :E], rank of each slot among
    earlier slots of the same expert in its chunk -> RANK (both deterministic)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < S
    ids = tl.load(IDS + offs, mask=ok, other=-1)
    valid = ids >= 0
    h = tl.histogram(tl.where(valid, ids, 0), E_P2, mask=valid)
    eo = tl.arange(0, E_P2)
    tl.store(HIST + c * E + eo, h, mask=eo < E)
    ii = tl.arange(0, CHUNK)
    same = (ids[:, None] == ids[None, :]) & (ii[None, :] < ii[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    tl.store(RANK + offs, rank, mask=ok)


@triton.jit
def scan_kernel(HIST, OFFS, BLK_E, BLK_R, NCH, E, NB,
                BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CB: tl.constexpr, BB: tl.constexpr):
    """One program: HIST[c, e] -> exclusive prefix over chunks (in place); expert offsets in the
    padded sorted order -> OFFS; the block table (expert and valid rows of each BLOCK_M block).

    The table is written per expert (one vector store per block index j < the largest expert's
    block count) and the tail past the last used block is filled with -1 (disjoint addresses)."""
    eo = tl.arange(0, E_P2)
    e_ok = eo < E
    carry = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, NCH, CB):
        co = c0 + tl.arange(0, CB)
        m = (co < NCH)[:, None] & e_ok[None, :]
        ptr = HIST + co[:, None] * E + eo[None, :]
        h = tl.load(ptr, mask=m, other=0)
        incl = tl.cumsum(h, axis=0)
        tl.store(ptr, incl - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
    nblk = (carry + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, axis=0)
    blk_start = blk_end - nblk
    tl.store(OFFS + eo, blk_start * BLOCK_M, mask=e_ok)
    for j in range(0, tl.max(nblk, axis=0)):
        live = e_ok & (j < nblk)
        tl.store(BLK_E + blk_start + j, eo, mask=live)
        tl.store(BLK_R + blk_start + j, tl.minimum(carry - j * BLOCK_M, BLOCK_M), mask=live)
    total = tl.sum(nblk, axis=0)
    for b0 in range(0, NB, BB):
        bo = b0 + tl.arange(0, BB)
        tail = (bo >= total) & (bo < NB)
        tl.store(BLK_E + bo, tl.full([BB], -1, tl.int32), mask=tail)
        tl.store(BLK_R + bo, tl.zeros([BB], dtype=tl.int32), mask=tail)


@triton.jit
def scatter_kernel(IDS, HIST, RANK, OFFS, SORTED, S, E, CHUNK: tl.constexpr):
    """SORTED[OFFS[e] + prefix(chunk, e) + rank] = slot for every valid slot."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < S
    ids = tl.load(IDS + offs, mask=ok, other=-1)
    valid = ok & (ids >= 0)
    e = tl.where(valid, ids, 0)
    pos = tl.load(OFFS + e, mask=valid, other=0) + tl.load(HIST + c * E + e, mask=valid, other=0) \
        + tl.load(RANK + offs, mask=valid, other=0)
    tl.store(SORTED + pos, offs, mask=valid)
