"""Triton kernel of the indexer's top-K transform: per row, the K best of the first seq_len scores,
translated through the page table.

Grid `(NPROG,)`: program p handles rows p, p + NPROG, ... (persistent, so the candidate workspace is
NPROG x CAP, not B x CAP). A row of L = min(seq_len, W) scores is viewed as a column-major grid of
G = 2K columns: position p sits in column p % G, row p // G, and a tile is [G, RA] (every row of
some columns' RA-row slab in one thread's registers, so per-column work needs no shuffles).

* ``seq_len <= K``: positions 0 .. seq_len-1 in order, then -1 (the scores are not read).
* otherwise, with keys = upstream's `convert_to_uint32` of the fp32 bits (unsigned key order =
  score order, -0.0 below +0.0):

  A. the max score of each column. The K-th largest column max bounds the K-th largest score from
     below (K distinct columns reach it). Columns are strided through the row, so a stretch of
     high scores spreads over many of them: about 600-750 positions reach the bound for any data
     in random order, and a contiguous run of high scores gives fewer.
  B. ``bound``: 5-bit radix passes (32-bin histograms) over the G column maxima narrow the bin
     holding the K-th largest until it holds <= SMALL: its lower edge v is the bound.
  C. every position with score >= v (or NaN) is compacted into this program's workspace, in
     (column, row) order, as (fp32 bits << 32 | position).
  D. the same radix passes over those candidates find the bin of the K-th largest key exactly:
     either its count is what is still needed (take the whole bin) or it is a single tied key
     (take its first `need` in (column, row) order).
  E. a packed prefix sum gives every selected candidate its output slot, its rank in (column,
     row) order; then the page translation and the stores.

  More than CAP candidates (heavy ties, adversarial rows): D and E read the row itself instead
  (E then counts per column first, to keep the same order) — slower, same result.

The output order — column-major over the [ceil(L / 2K), 2K] grid, i.e. by (p % 2K, p // 2K) — is
ascending position for rows of at most 2K scores. Histogram counts are integer atomics in shared
memory (their sum does not depend on order), so every result is deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

NBINS = tl.constexpr(32)  # one radix digit = 5 bits
DIGIT = tl.constexpr(5)
RT = tl.constexpr(8)  # rows (of 2K positions) per tile of a long row: part of the output order
KEY_POS_INF = tl.constexpr(0xFF800000)  # _keys(+inf)
KEY_NEG_INF = tl.constexpr(0x007FFFFF)  # _keys(-inf)


@triton.jit
def _keys(bits):
    """int32 fp32-bit patterns -> uint32 keys whose unsigned order is upstream's score order."""
    flip = (bits >> 31).to(tl.uint32, bitcast=True) | 0x80000000
    return bits.to(tl.uint32, bitcast=True) ^ flip


@triton.jit
def _score_at_least(v):
    """A float f with score >= f (or NaN) for every score whose key is >= the int64 key v."""
    pos_half = v >= 0x80000000
    bits = tl.where(pos_half, v - 0x80000000, 0xFFFFFFFF - v).to(tl.int32)
    f = bits.to(tl.float32, bitcast=True)
    f = tl.where(v > KEY_POS_INF, float("inf"), f)  # v inside the NaN keys: keep +inf and NaNs
    return tl.where(v < KEY_NEG_INF, float("-inf"), f)  # below -inf: keep everything


@triton.jit
def _bit_length(x):
    """Bits needed for the non-negative int64 scalar x (0 for 0)."""
    w = x * 0
    while (x >> w) > 0:
        w += 1
    return w


@triton.jit
def _pick_bin(h, need):
    """The bin holding the `need`-th largest of the histogram `h`: (bin, count above it, its count)."""
    b = tl.arange(0, NBINS)
    incl = tl.cumsum(h, 0, reverse=True)  # count in bins >= b
    above = incl - h
    hit = (above < need) & (incl >= need)
    j = tl.sum(tl.where(hit, b, 0), 0)
    a = tl.sum(tl.where(hit, above, 0), 0)
    c = tl.sum(tl.where(hit, h, 0), 0)
    return j, a, c


@triton.jit
def _digit_hist(key, ok, lo_u, hi_u, s):
    """32-bin histogram of digit (key - lo) >> s over the keys in [lo, hi]."""
    m = ok & (key >= lo_u) & (key <= hi_u)
    d = tl.where(m, ((key - lo_u) >> s.to(tl.uint32)).to(tl.int32), 0)
    return tl.histogram(d, NBINS, mask=m)


@triton.jit
def _radix_start(kmin, kmax):
    """(lo, w): the aligned bin [lo, lo + 2^w) holding every key in [kmin, kmax] (int64 scalars)."""
    w = _bit_length(kmin ^ kmax)
    return (kmin >> w) << w, w


@triton.jit
def _bin_hi(lo, w):
    return (lo + (1 << w) - 1).to(tl.uint32)


@triton.jit
def _tile(ROW, L, r0, G: tl.constexpr, RA: tl.constexpr):
    """Scores [G, RA] of rows r0 .. r0+RA-1 of the grid (-inf outside the row), positions, validity."""
    pos = tl.arange(0, G)[:, None] + (r0 + tl.arange(0, RA))[None, :] * G
    ok = pos < L
    x = tl.load(ROW + pos, mask=ok, other=float("-inf"))
    return x, pos, ok


@triton.jit
def _translate(PT_ROW, pt_cols, pos, sel, page_bits):
    """Upstream's page_to_indices: (page_table[pos >> bits] << bits) | (pos & (2^bits - 1))."""
    col = pos >> page_bits
    page = tl.load(PT_ROW + col, mask=sel & (col < pt_cols), other=0)
    return (page << page_bits) | (pos & ((1 << page_bits) - 1))


@triton.jit
def _naive_row(OUT_ROW, RAW_ROW, PT_ROW, pt_cols, n, page_bits, K: tl.constexpr, HAS_RAW: tl.constexpr):
    i = tl.arange(0, K)
    ok = i < n
    idx = tl.where(ok, _translate(PT_ROW, pt_cols, i, ok, page_bits), -1)
    tl.store(OUT_ROW + i, idx)
    if HAS_RAW:
        tl.store(RAW_ROW + i, tl.where(ok, i, -1))


@triton.jit
def _bound(gmax, L, K: tl.constexpr, SMALL: tl.constexpr):
    """B: a key v with at least K column maxima >= v and few (<= SMALL) in [v, its bin's top]."""
    G: tl.constexpr = 2 * K
    valid = tl.arange(0, G) < L
    gk = _keys(gmax.to(tl.int32, bitcast=True))
    kmax = tl.max(tl.where(valid, gk, 0), 0).to(tl.int64)
    kmin = tl.min(tl.where(valid, gk, 0xFFFFFFFF), 0).to(tl.int64)
    lo, w = _radix_start(kmin, kmax)
    need = tl.full([], K, tl.int32)
    go = tl.full([], 1, tl.int1)
    while go:
        s = tl.maximum(w - DIGIT, 0)
        lo_u = lo.to(tl.uint32)
        h = _digit_hist(gk, valid, lo_u, _bin_hi(lo, w), s)
        j, a, c = _pick_bin(h, need)
        need = need - a
        lo = lo + (j.to(tl.int64) << s)
        w = s
        go = (c > SMALL) & (w > 0)
    return lo


@triton.jit
def _store_candidates(x, pos, fi, slot, WS, CAP: tl.constexpr):
    """C's stores: flagged scores as (fp32 bits << 32 | position) at their slots below CAP."""
    val = (x.to(tl.int32, bitcast=True).to(tl.int64) << 32) | pos.to(tl.int64)
    tl.store(WS + slot, val, mask=(fi != 0) & (slot < CAP))


@triton.jit
def _flags(x, ok, vf):
    """Candidates of C: score >= vf, or NaN (a NaN with the sign bit clear outranks +inf)."""
    return (ok & ~(x < vf)).to(tl.int32)


@triton.jit
def _candidates_short(ROW, L, WS, K: tl.constexpr, RA: tl.constexpr, SMALL: tl.constexpr,
                      CAP: tl.constexpr):
    """A-C for a row of at most 2K * RA <= 2K * RT scores: one tile, kept in registers.
    -> (candidate count, bound key v)."""
    G: tl.constexpr = 2 * K
    x, pos, ok = _tile(ROW, L, 0, G, RA)
    v = _bound(tl.max(x, 1), L, K, SMALL)
    fi = _flags(x, ok, _score_at_least(v))
    cnt = tl.sum(fi, 1)
    _store_candidates(x, pos, fi, (tl.cumsum(cnt, 0) - cnt)[:, None] + tl.cumsum(fi, 1) - fi, WS, CAP)
    return tl.sum(cnt, 0), v


@triton.jit
def _candidates_long(ROW, L, WS, K: tl.constexpr, SMALL: tl.constexpr, CAP: tl.constexpr):
    """A-C for a row of any length: tiles of RT rows, two passes (max; then flag and store, tile by
    tile, so the order is (tile, column, row))."""
    G: tl.constexpr = 2 * K
    rows = tl.cdiv(L, G)
    gmax = tl.full([G], float("-inf"), tl.float32)
    for r0 in range(0, rows, RT):
        x, pos, ok = _tile(ROW, L, r0, G, RT)
        gmax = tl.maximum(gmax, tl.max(x, 1))
    v = _bound(gmax, L, K, SMALL)
    vf = _score_at_least(v)
    n = L * 0
    for r0 in range(0, rows, RT):
        x, pos, ok = _tile(ROW, L, r0, G, RT)
        fi = _flags(x, ok, vf)
        cnt = tl.sum(fi, 1)
        _store_candidates(x, pos, fi, n + (tl.cumsum(cnt, 0) - cnt)[:, None] + tl.cumsum(fi, 1) - fi, WS, CAP)
        n += tl.sum(cnt, 0)
    return n, v


@triton.jit
def _select_buffer(WS, n, OUT_ROW, RAW_ROW, PT_ROW, pt_cols, page_bits, K: tl.constexpr,
                   CAP: tl.constexpr, HAS_RAW: tl.constexpr):
    """D + E over the n <= CAP workspace candidates (already in output order)."""
    i = tl.arange(0, CAP)
    val = tl.load(WS + i, mask=i < n, other=0)
    pos = val.to(tl.int32)
    key = _keys((val >> 32).to(tl.int32))
    ok = i < n
    kmin = tl.min(tl.where(ok, key, 0xFFFFFFFF), 0).to(tl.int64)
    lo, w = _radix_start(kmin, tl.max(tl.where(ok, key, 0), 0).to(tl.int64))
    need = tl.full([], K, tl.int32)
    go = tl.full([], 1, tl.int1)
    while go:
        s = tl.maximum(w - DIGIT, 0)
        h = _digit_hist(key, ok, lo.to(tl.uint32), _bin_hi(lo, w), s)
        j, a, c = _pick_bin(h, need)
        need = need - a
        lo = lo + (j.to(tl.int64) << s)
        w = s
        go = (c != need) & (w > 0)
    hi_u = _bin_hi(lo, w)
    above = ok & (key > hi_u)
    inbin = ok & (key >= lo.to(tl.uint32)) & (key <= hi_u)
    pk = above.to(tl.int32) + (inbin.to(tl.int32) << 16)  # CAP < 2^16: both counts in one scan
    ex = tl.cumsum(pk, 0) - pk
    rank_in = ex >> 16
    sel = above | (inbin & (rank_in < need))
    slot = (ex & 0xFFFF) + tl.minimum(rank_in, need)
    tl.store(OUT_ROW + slot, _translate(PT_ROW, pt_cols, pos, sel, page_bits), mask=sel)
    if HAS_RAW:
        tl.store(RAW_ROW + slot, pos, mask=sel)


@triton.jit
def _select_row(ROW, L, vf, OUT_ROW, RAW_ROW, PT_ROW, pt_cols, page_bits, K: tl.constexpr, HAS_RAW: tl.constexpr):
    """D + E straight from the row (more than CAP candidates): same selection, same order."""
    G: tl.constexpr = 2 * K
    CH: tl.constexpr = G * RT
    rows = tl.cdiv(L, G)
    lo, w = _radix_start(tl.full([], 0, tl.int64), tl.full([], 0xFFFFFFFF, tl.int64))
    need = tl.full([], K, tl.int32)
    go = tl.full([], 1, tl.int1)
    while go:
        s = tl.maximum(w - DIGIT, 0)
        lo_u = lo.to(tl.uint32)
        hi_u = _bin_hi(lo, w)
        h = tl.zeros([NBINS], tl.int32)
        for c0 in range(0, L, CH):  # histograms do not care about order: plain 1-D chunks
            i = c0 + tl.arange(0, CH)
            x = tl.load(ROW + i, mask=i < L, other=float("-inf"))
            h += _digit_hist(_keys(x.to(tl.int32, bitcast=True)), _flags(x, i < L, vf) != 0, lo_u, hi_u, s)
        j, a, c = _pick_bin(h, need)
        need = need - a
        lo = lo + (j.to(tl.int64) << s)
        w = s
        go = (c != need) & (w > 0)
    lo_u = lo.to(tl.uint32)
    hi_u = _bin_hi(lo, w)
    n_ab = L * 0
    n_in = L * 0
    for r0 in range(0, rows, RT):
        x, pos, ok = _tile(ROW, L, r0, G, RT)
        key = _keys(x.to(tl.int32, bitcast=True))
        ok = _flags(x, ok, vf) != 0
        ab = (ok & (key > hi_u)).to(tl.int32)
        inb = (ok & (key >= lo_u) & (key <= hi_u)).to(tl.int32)
        c_ab = tl.sum(ab, 1)
        c_in = tl.sum(inb, 1)
        rank_in = n_in + (tl.cumsum(c_in, 0) - c_in)[:, None] + tl.cumsum(inb, 1) - inb
        sel = (ab != 0) | ((inb != 0) & (rank_in < need))
        slot = n_ab + (tl.cumsum(c_ab, 0) - c_ab)[:, None] + tl.cumsum(ab, 1) - ab + tl.minimum(rank_in, need)
        tl.store(OUT_ROW + slot, _translate(PT_ROW, pt_cols, pos, sel, page_bits), mask=sel)
        if HAS_RAW:
            tl.store(RAW_ROW + slot, pos, mask=sel)
        n_ab += tl.sum(c_ab, 0)
        n_in += tl.sum(c_in, 0)


@triton.jit
def topk_transform_kernel(
    SC, stride_sb,  # fp32 scores [B, >= W] (last dim contiguous)
    SEQ,  # int32 [B]
    PT, stride_pb, pt_cols,  # int32 page table [B, pt_cols] (last dim contiguous)
    OUT,  # int32 [B, K] contiguous
    RAW,  # int32 [B, K] contiguous (only with HAS_RAW)
    WS,  # int64 workspace [NPROG, CAP]
    B, W, page_bits,
    K: tl.constexpr,
    CAP: tl.constexpr,  # candidate slots per program
    SMALL: tl.constexpr,  # B stops once the bin of the K-th column max holds <= SMALL
    HAS_RAW: tl.constexpr,
):
    pid = tl.program_id(0)
    G: tl.constexpr = 2 * K
    WSP = WS + pid.to(tl.int64) * CAP
    for b in range(pid, B, tl.num_programs(0)):
        b64 = tl.cast(b, tl.int64)
        seq = tl.load(SEQ + b)
        OUT_ROW = OUT + b64 * K
        RAW_ROW = RAW + b64 * K
        PT_ROW = PT + b64 * stride_pb
        L = tl.minimum(seq, W)
        if L <= K:
            # upstream's short-row branch (it tests seq_len <= K, where it never reads the scores);
            # L < seq only when seq_len > W, rows upstream would read past.
            _naive_row(OUT_ROW, RAW_ROW, PT_ROW, pt_cols, tl.where(seq <= K, seq, L), page_bits, K, HAS_RAW)
        else:
            ROW = SC + b64 * stride_sb
            # one-tile paths sized to the row (the order is the same: rows past L are empty)
            if L <= G:
                n, v = _candidates_short(ROW, L, WSP, K, 1, SMALL, CAP)
            elif L <= 2 * G:
                n, v = _candidates_short(ROW, L, WSP, K, 2, SMALL, CAP)
            elif L <= 4 * G:
                n, v = _candidates_short(ROW, L, WSP, K, 4, SMALL, CAP)
            elif L <= RT * G:
                n, v = _candidates_short(ROW, L, WSP, K, RT, SMALL, CAP)
            else:
                n, v = _candidates_long(ROW, L, WSP, K, SMALL, CAP)
            tl.debug_barrier()  # the workspace stores above, before any thread reads them
            if n <= CAP:
                _select_buffer(WSP, n, OUT_ROW, RAW_ROW, PT_ROW, pt_cols, page_bits, K, CAP, HAS_RAW)
            else:
                _select_row(ROW, L, _score_at_least(v), OUT_ROW, RAW_ROW, PT_ROW, pt_cols, page_bits, K, HAS_RAW)
            tl.debug_barrier()  # this row's reads of the workspace, before the next row's writes
