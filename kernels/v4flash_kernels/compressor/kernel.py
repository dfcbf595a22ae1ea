"""The DeepSeek-V4 compressor's decode step in one Triton kernel: wkv_gate GEMV, state ring, pooling,
RMSNorm + RoPE (+ Hadamard), FP8 quant and the paged-cache store.

What one call computes (sglang 0.5.13.post1's default CUDA path, `compressor_v2.forward_unified` at a
decode batch: `linear_bf16_fp32`, the JIT `compress_forward` (`c4_v2.cuh` / `c128_v2.cuh`) and
`compress_norm_rope_store` (`fused_norm_rope_v2.cuh`)), for T <= 16 rows:

* ``kv_score[t] = x[t] . W^T`` in fp32 (bf16 inputs, fp32 accumulation): the new row of the state.
  Its columns are sections of `HD` (c4: kv overlap | kv | score overlap | score; c128: kv | score).
* ring update: ``STATE[write_loc[t]] = kv_score[t]`` (every row).
* rows whose window completes (``seq_len % RATIO == 0``): per head dim d, the softmax over the
  window's slots of (score + ape) weighting the window's kv, read from the state after the update
  (c4: 4 slots of the previous page's overlap halves, none for the first window, and the 4 slots of
  this page; c128: the page's 128 slots).
* that pooled vector: RMSNorm with the norm weight, RoPE of its last 64 dims at position
  ``seq_len - RATIO`` (interleaved pairs), and for the indexer the 128-point Hadamard (1/sqrt(128));
  then stored at ``out_loc[t]`` of the paged cache: FlashMLA's 584-byte token (448 e4m3 codes with a
  UE8M0 scale per 64, the rope dims as bf16) or the indexer's 132-byte key (128 e4m3 codes, one
  fp32 scale).

Parallel layout: program p owns head dims ``[p*BD, (p+1)*BD)`` and the weight rows of all its
sections, so it holds whole kv and score columns: it computes them over the whole K (one stream of
its weight rows, no split), writes them into the ring and pools its own head dims. The GEMV: up to 4
rows (``MMA`` off) the program requests its whole [2*COFF*BD, K] tile at once (8 or 4 rows of 8 KB,
16-byte loads, every byte in flight together) and reduces it against each row of x on the CUDA cores;
5-16 rows, tensor-core dots over BK-wide ``cp.async``-pipelined steps, T padded to 16 and the rows to
16 by masked loads that move no bytes. The
norm, the rotary pairs, the Hadamard and the 64-wide quant groups span every head dim, so the
pooled rows go through a small fp32 scratch and the last program to finish (an integer ticket, the
only atomic; no floating-point atomics, no waiting on other programs) normalises, rotates, quantizes
and stores them. A step where no row completes a window skips the ticket and the scratch.

Under Triton's CPU interpreter (``INTERPRET``): the bf16 dot is done on fp32 copies (its bf16 dot is
wrong there); every rounding to bf16 and to e4m3 is spelled out in integer arithmetic on both
(the interpreter truncates float casts), so the two agree bit for bit on the same fp32 values.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
NEG_MAX = tl.constexpr(-3.4028234663852886e38)  # upstream's "no overlap window" score (-FLT_MAX)
SCALE_FLOOR = tl.constexpr(1e-4)  # upstream's amax floor of both store formats
ROPE_DIM = tl.constexpr(64)
NOPE_DIM = tl.constexpr(448)  # FlashMLA token: 448 fp8 codes, then 64 bf16 rope dims (576 bytes)
MLA_TOKEN_BYTES = tl.constexpr(576)
MLA_SCALE_BYTES = tl.constexpr(8)  # 7 UE8M0 scales + 1 pad byte per token, after the page's tokens
IDX_TOKEN_BYTES = tl.constexpr(128)  # indexer token: 128 fp8 codes; the fp32 scales follow the page's codes


@triton.jit
def bf16_rne(v):
    """fp32 -> the nearest bf16 value (ties to even), as fp32: what CUDA's `cast<bf16_t>` gives."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_code(v):
    """`v` (fp32, |v| <= 448) -> its e4m3fn byte, rounded to nearest even (`cvt.rn.satfinite`)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    # normals (|v| >= 2^-6): keep 3 of 23 mantissa bits, ties to even; a carry bumps the exponent
    ab = a.to(tl.int32, bitcast=True)
    rn = (ab + 0x7FFFF + ((ab >> 20) & 1)) & -1048576
    normal = (((rn >> 23) - 120) << 3) | ((rn >> 20) & 7)
    # subnormals: multiples of 2^-9 (0..8: 8 is the smallest normal, code 8 as well)
    sub = ((a + 24576.0) - 24576.0) * 512.0
    code = tl.where(a < 0.015625, sub.to(tl.int32), normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def ue8m0_of(scale):
    """UE8M0 exponent byte of a positive fp32 scale, rounded up (upstream's `cast_to_ue8m0`), and
    the fp32 reciprocal of its power of two (`inv_scale_ue8m0`)."""
    u = scale.to(tl.int32, bitcast=True)
    e = ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return e, inv


@triton.jit
def _rope(y, pos, ok, FREQS, stride_f, ROWS: tl.constexpr, HD: tl.constexpr):
    """RoPE of the last 64 dims of `y` [ROWS, HD] (interleaved (re, im) pairs), row r at `pos[r]`;
    the other pairs are multiplied by (1, 0), which leaves them exactly as they are."""
    HALF: tl.constexpr = HD // 2
    FIRST: tl.constexpr = (HD - ROPE_DIM) // 2
    re, im = tl.split(tl.reshape(y, (ROWS, HALF, 2)))
    pi = tl.arange(0, HALF)
    is_rope = pi >= FIRST
    fi = tl.where(is_rope, pi - FIRST, 0)
    f_ptr = FREQS + pos.to(tl.int64)[:, None] * stride_f + 2 * fi[None, :]
    m = ok[:, None] & is_rope[None, :]
    c = tl.load(f_ptr, mask=m, other=1.0)
    s = tl.load(f_ptr + 1, mask=m, other=0.0)
    return tl.reshape(tl.join(re * c - im * s, re * s + im * c), (ROWS, HD))


@triton.jit
def _hadamard128(y, ROWS: tl.constexpr):
    """The 128-point Sylvester Hadamard of each row, index bit 0 first (upstream's butterfly order:
    the lower index keeps the sum, the upper the difference), then x rsqrt(128)."""
    for b in tl.static_range(7):
        y4 = tl.permute(tl.reshape(y, (ROWS, 64 >> b, 2, 1 << b)), (0, 1, 3, 2))
        lo, hi = tl.split(y4)
        y = tl.reshape(tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 3, 2)), (ROWS, 128))
    return y * tl.rsqrt(tl.full((ROWS, 128), 128.0, tl.float32))


@triton.jit
def _store_rows(POOLED, PLAN, OUT_LOC, NORM_W, eps, FREQS, stride_f, CACHE, CACHE_W, page_bytes, page_bits,
                T, t0, HD: tl.constexpr, RATIO: tl.constexpr, INDEXER: tl.constexpr, EPI_T: tl.constexpr):
    """Rows t0 .. t0+EPI_T-1: norm + RoPE (+ Hadamard) of the completed windows' pooled rows, quantized
    into the paged cache (only rows that completed a window are read or written)."""
    t = t0 + tl.arange(0, EPI_T)
    t_ok = t < T
    seq = tl.load(PLAN + t * 4, mask=t_ok, other=1)
    done = t_ok & (seq > 0) & (seq % RATIO == 0)
    loc = tl.load(OUT_LOC + t, mask=done, other=0)
    d = tl.arange(0, HD)
    x = tl.load(POOLED + t[:, None] * HD + d[None, :], mask=done[:, None], other=0.0, cache_modifier=".cg")
    rms = tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps)
    y = x * rms[:, None] * tl.load(NORM_W + d)[None, :]
    y = _rope(y, seq - RATIO, done, FREQS, stride_f, EPI_T, HD)
    page = (loc >> page_bits).to(tl.int64)
    slot = (loc & ((1 << page_bits) - 1)).to(tl.int64)
    page_base = page * page_bytes
    if INDEXER:
        y = _hadamard128(y, EPI_T)
        amax = tl.max(tl.abs(y), axis=1)
        scale = tl.math.div_rn(tl.maximum(amax, SCALE_FLOOR), tl.full(amax.shape, FP8_MAX, tl.float32))
        inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
        v = tl.clamp(y * inv[:, None], -FP8_MAX, FP8_MAX)
        codes = e4m3_code(v)
        tl.store(CACHE + (page_base + slot * IDX_TOKEN_BYTES)[:, None] + d[None, :], codes, mask=done[:, None])
        # the fp32 scales follow the page's 2^page_bits codes: CACHE_W is the fp32 view of the cache
        s_word = (page_base + (IDX_TOKEN_BYTES << page_bits) + slot * 4) // 4
        tl.store(CACHE_W + s_word, scale, mask=done)
    else:
        yb = bf16_rne(y)  # the nope dims go through bf16 first, as upstream's store does
        G: tl.constexpr = HD // 64
        g3 = tl.reshape(yb, (EPI_T, G, 64))
        amax = tl.max(tl.abs(g3), axis=2)  # [EPI_T, G]; the last group is the rope dims (not quantized)
        scale = tl.math.div_rn(tl.maximum(amax, SCALE_FLOOR), tl.full(amax.shape, FP8_MAX, tl.float32))
        e, inv = ue8m0_of(scale)
        v = tl.clamp(g3 * inv[:, :, None], -FP8_MAX, FP8_MAX)
        codes = tl.reshape(e4m3_code(v), (EPI_T, HD))
        token = page_base + slot * MLA_TOKEN_BYTES
        nope = d < NOPE_DIM
        tl.store(CACHE + token[:, None] + d[None, :], codes, mask=done[:, None] & nope[None, :])
        # rope dims: bf16 at bytes 448.. of the token; CACHE_W is the bf16 view of the cache
        tl.store(CACHE_W + (token // 2 + (NOPE_DIM // 2 - NOPE_DIM))[:, None] + d[None, :], yb.to(tl.bfloat16),
                 mask=done[:, None] & (d >= NOPE_DIM)[None, :])
        gi = tl.arange(0, G)
        s_ptr = CACHE + (page_base + (MLA_TOKEN_BYTES << page_bits) + slot * MLA_SCALE_BYTES)[:, None] + gi[None, :]
        tl.store(s_ptr, e.to(tl.uint8), mask=done[:, None] & (gi < NOPE_DIM // 64)[None, :])


@triton.jit
def compressor_decode_kernel(
    X, stride_x,  # [T, K] bf16, K contiguous
    W,  # [N, K] bf16 contiguous, N = 2 * COFF * HD: the wkv_gate weight
    PLAN,  # [T, 4] int32: seq_len, write_loc (ring slot), read_page_0 (previous window), read_page_1
    STATE,  # [slots, N] fp32: the ring (page = RATIO consecutive slots)
    APE,  # [RATIO * COFF, HD] fp32 (c4: rows 0-3 bias the overlap window, rows 4-7 this one)
    NORM_W, eps,  # [HD] fp32
    FREQS, stride_f,  # [positions, 64] fp32: (cos, sin) of each rotary pair
    OUT_LOC,  # [T] int32: the compressed token's cache location
    CACHE, CACHE_W, page_bytes, page_bits,  # the paged cache (uint8) and its bf16 (FlashMLA) / fp32 (indexer) view
    POOLED,  # [T, HD] fp32 scratch: the completed windows' pooled rows
    CNT,  # int32 ticket, zero between calls
    T,
    K: tl.constexpr,
    HD: tl.constexpr,
    RATIO: tl.constexpr,
    INDEXER: tl.constexpr,
    BD: tl.constexpr,  # head dims per program
    ROWS_PAD: tl.constexpr,  # 2 * COFF * BD weight rows, padded to the dot's 16
    BK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EPI_T: tl.constexpr,  # rows the finishing program stores at a time
    MMA: tl.constexpr,  # tensor-core dots over BK-wide steps (5..16 rows), else one load of the whole tile
    INTERPRET: tl.constexpr,
):
    """Grid (HD // BD,): see the module docstring."""
    COFF: tl.constexpr = 2 if RATIO == 4 else 1
    N: tl.constexpr = 2 * COFF * HD
    ROWS: tl.constexpr = 2 * COFF * BD
    pid = tl.program_id(0)

    # ---- GEMV: this program's weight rows (all sections of its head dims) over the whole K
    r = tl.arange(0, ROWS_PAD)
    r_ok = r < ROWS
    col = (r // BD) * HD + pid * BD + r % BD  # weight row = state column
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    acc = tl.zeros((ROWS_PAD, BLOCK_T), dtype=tl.float32)
    if MMA:
        # T padded to the dot's 16, the rows past ROWS masked (no bytes moved), BK-wide pipelined steps
        k = tl.arange(0, BK)
        w_ptr = W + col.to(tl.int64)[:, None] * K + k[None, :]
        x_ptr = X + t.to(tl.int64)[None, :] * stride_x + k[:, None]
        for kk in range(0, K, BK):
            w = tl.load(w_ptr + kk, mask=r_ok[:, None], other=0.0)
            xt = tl.load(x_ptr + kk, mask=t_ok[None, :], other=0.0)
            if INTERPRET:
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
            else:
                acc = tl.dot(w, xt, acc)
    else:
        # few rows (BLOCK_T = 4): the whole [ROWS, K] tile requested at once, as four K-quarters (every
        # byte in flight together), then reduced quarter by quarter on the CUDA cores in fp32 against
        # each row of x (one quarter converted to fp32 at a time: the tile stays bf16 in registers)
        tl.static_assert(BLOCK_T == 4)
        KC: tl.constexpr = K // 4
        kc = tl.arange(0, KC)
        wp = W + col.to(tl.int64)[:, None] * K + kc[None, :]
        w0 = tl.load(wp)
        w1 = tl.load(wp + KC)
        w2 = tl.load(wp + 2 * KC)
        w3 = tl.load(wp + 3 * KC)
        a0 = tl.zeros((ROWS_PAD,), dtype=tl.float32)
        a1 = tl.zeros((ROWS_PAD,), dtype=tl.float32)
        a2 = tl.zeros((ROWS_PAD,), dtype=tl.float32)
        a3 = tl.zeros((ROWS_PAD,), dtype=tl.float32)
        for c in tl.static_range(4):
            if c == 0:
                wf = w0.to(tl.float32)
            elif c == 1:
                wf = w1.to(tl.float32)
            elif c == 2:
                wf = w2.to(tl.float32)
            else:
                wf = w3.to(tl.float32)
            xb = X + c * KC + kc
            a0 += tl.sum(wf * tl.load(xb, mask=kc < KC * (T > 0), other=0.0).to(tl.float32)[None, :], axis=1)
            a1 += tl.sum(wf * tl.load(xb + stride_x, mask=kc < KC * (T > 1), other=0.0).to(tl.float32)[None, :],
                         axis=1)
            a2 += tl.sum(wf * tl.load(xb + 2 * stride_x, mask=kc < KC * (T > 2), other=0.0).to(tl.float32)[None, :],
                         axis=1)
            a3 += tl.sum(wf * tl.load(xb + 3 * stride_x, mask=kc < KC * (T > 3), other=0.0).to(tl.float32)[None, :],
                         axis=1)
        acc = tl.where((t == 0)[None, :], a0[:, None], acc)
        acc = tl.where((t == 1)[None, :], a1[:, None], acc)
        acc = tl.where((t == 2)[None, :], a2[:, None], acc)
        acc = tl.where((t == 3)[None, :], a3[:, None], acc)

    # ---- the state ring: every row's new kv + score at its write slot
    seq = tl.load(PLAN + t * 4, mask=t_ok, other=1)
    wloc = tl.load(PLAN + t * 4 + 1, mask=t_ok, other=-1)
    tl.store(STATE + wloc.to(tl.int64)[None, :] * N + col[:, None], acc,
             mask=r_ok[:, None] & (t_ok & (wloc >= 0))[None, :])

    done = t_ok & (seq > 0) & (seq % RATIO == 0)
    if tl.max(done.to(tl.int32), axis=0) > 0:
        tl.debug_barrier()  # this program's ring stores before its window loads (the same slots)
        d = pid * BD + tl.arange(0, BD)
        if RATIO == 4:
            # window slots j = 0..7: the previous page's overlap halves (j < 4), this page's main halves
            j = tl.arange(0, 8)
            first = j < 4
            p0 = tl.load(PLAN + t * 4 + 2, mask=done, other=0)
            p1 = tl.load(PLAN + t * 4 + 3, mask=done, other=0)
            page = tl.where(first[None, :], p0[:, None], p1[:, None])
            use = done[:, None] & ((seq > 4)[:, None] | (~first)[None, :])  # no overlap in the first window
            base = ((page * 4 + (j % 4)[None, :]).to(tl.int64) * N)[:, :, None] + d[None, None, :]
            kv_off = tl.where(first, 0, HD)[None, :, None]
            sc_off = tl.where(first, 2 * HD, 3 * HD)[None, :, None]
            m = use[:, :, None] & (d < HD)[None, None, :]
            kv = tl.load(STATE + base + kv_off, mask=m, other=0.0)
            sc = tl.load(STATE + base + sc_off, mask=m, other=NEG_MAX)
            ape = tl.load(APE + j[:, None] * HD + d[None, :])
            s = sc + ape[None, :, :]
            mx = tl.max(s, axis=1)
            e = tl.exp(s - mx[:, None, :])
            pooled = tl.sum(kv * e, axis=1) / tl.sum(e, axis=1)
            tl.store(POOLED + t[:, None] * HD + d[None, :], pooled, mask=done[:, None] & (d < HD)[None, :])
        else:
            j = tl.arange(0, RATIO)
            ape = tl.load(APE + j[:, None] * HD + d[None, :])
            for ti in range(0, T):
                s_len = tl.load(PLAN + ti * 4)
                if (s_len > 0) & (s_len % RATIO == 0):
                    p1 = tl.load(PLAN + ti * 4 + 3)
                    base = (p1 * RATIO + j).to(tl.int64)[:, None] * N + d[None, :]
                    kv = tl.load(STATE + base)
                    s = tl.load(STATE + base + HD) + ape
                    mx = tl.max(s, axis=0)
                    e = tl.exp(s - mx[None, :])
                    tl.store(POOLED + ti * HD + d, tl.sum(kv * e, axis=0) / tl.sum(e, axis=0))
        # The barrier orders every thread's scratch stores before the release; the acquire and the
        # .cg loads (past the non-coherent L1) make every program's rows visible to the last one.
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            for t0 in tl.static_range(0, BLOCK_T, EPI_T):
                _store_rows(POOLED, PLAN, OUT_LOC, NORM_W, eps, FREQS, stride_f, CACHE, CACHE_W, page_bytes,
                            page_bits, T, t0, HD, RATIO, INDEXER, EPI_T)
            tl.atomic_xchg(CNT, 0, sem="relaxed", scope="gpu")
