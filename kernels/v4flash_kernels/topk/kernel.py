"""Triton kernel of the indexer's top-K transform: per row, the K best of the first seq_len scores,
translated through the page table.

Grid `(NPROG,)`: program p handles rows p, p + NPROG, ... (persistent: the workspaces are per
program, not per row). A row of L = min(seq_len, W) scores is read as a grid of G = 2K columns,
position p in column p % G, row p // G, through [G, RA] tiles that keep a column's RA scores in
one thread's registers (per-column work needs no shuffles).

* ``seq_len <= K``: positions 0 .. seq_len-1 in order, then -1 (the scores are not read).
* otherwise, over keys = upstream's `convert_to_uint32` of the fp32 bits (unsigned key order is
  its score order; -0.0 below +0.0):

  A. the max score of each column. The K-th largest column max bounds the K-th largest score
     from below (K distinct columns reach it). Columns are strided through the row, so a stretch
     of high scores spreads over many of them: about 600-750 positions reach the bound for data
     in random order, fewer for a contiguous run of high scores.
  B. ``bound``: 5-bit radix passes (32-bin histograms) over the G maxima narrow the bin holding
     the K-th largest until it holds <= SMALL of them: its lower edge v is the bound.
  C. every position with score >= v (or NaN) goes to this program's workspace as (fp32 bits << 32
     | position), in output order. A row of one tile (<= 4G) does this from registers; a longer
     row keeps the max of every (tile of 8 rows, column) in pass A, lists the pairs whose max
     reaches v and re-reads only those.
  D. the same radix passes over the candidates find the bin of the K-th largest key exactly:
     either its count is what is still needed (take the whole bin) or it is one tied key (take its
     first `need` candidates in order).
  E. a packed prefix sum gives each selected candidate its output slot (its rank in the order),
     then the page translation and the stores.

  More than CAP candidates (heavy ties, adversarial rows): D and E read the row itself instead —
  slower, same result.

Output order: column-major over the grid, i.e. by (p % G, p // G) — ascending position for rows
of at most G = 2K scores. Histogram counts are integer atomics in shared memory (their sum does
not depend on order), so every result is deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

DIGIT = tl.constexpr(5)  # bits resolved per radix pass: 32 bins, one a lane, reductions stay in a warp
NBINS = tl.constexpr(32)
TILE_ROWS = 4  # rows of G positions per tile of a long row (any value gives the same output)
RT = tl.constexpr(TILE_ROWS)
NTB = tl.constexpr(4)  # tiles listed per step of a long row's (column, tile) list
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
    bits = tl.where(v >= 0x80000000, v - 0x80000000, 0xFFFFFFFF - v).to(tl.int32)
    f = bits.to(tl.float32, bitcast=True)
    f = tl.where(v > KEY_POS_INF, float("inf"), f)  # v among the NaN keys: keep +inf and NaNs
    return tl.where(v < KEY_NEG_INF, float("-inf"), f)  # below -inf: keep everything


@triton.jit
def _reaches(x, vf):
    """score >= vf, or NaN (a NaN with the sign bit clear outranks +inf)."""
    return ~(x < vf)


@triton.jit
def _bit_length(x):
    """Bits needed for the non-negative int64 scalar x (0 for 0)."""
    w = x * 0
    while (x >> w) > 0:
        w += 1
    return w


@triton.jit
def _radix_start(kmin, kmax):
    """(lo, w): the aligned bin [lo, lo + 2^w) holding every key in [kmin, kmax] (int64 scalars)."""
    w = _bit_length(kmin ^ kmax)
    return (kmin >> w) << w, w


@triton.jit
def _digit_hist(key, ok, lo, w, s):
    """Histogram of the keys in [lo, lo + 2^w) by digit (key - lo) >> s, highest digit in bin 0."""
    lo_u = lo.to(tl.uint32)
    m = ok & (key >= lo_u) & (key <= (lo + (1 << w) - 1).to(tl.uint32))
    d = (NBINS - 1) - ((key - lo_u) >> s.to(tl.uint32)).to(tl.int32)
    return tl.histogram(tl.where(m, d, 0), NBINS, mask=m)


@triton.jit
def _radix_step(h, lo, w, s, need):
    """Narrow [lo, lo + 2^w) to the 2^s-wide bin holding the `need`-th largest key.
    -> (lo, w, need still to take from the new bin, the new bin's count)."""
    b = tl.arange(0, NBINS)
    above = tl.cumsum(h, 0) - h  # keys in higher digits
    hit = (above < need) & (above + h >= need)
    j = tl.sum(tl.where(hit, b, 0), 0)
    a = tl.sum(tl.where(hit, above, 0), 0)
    c = tl.sum(tl.where(hit, h, 0), 0)
    lo = lo + (tl.cast(NBINS - 1 - j, tl.int64) << s)
    return lo, s, need - a, c


@triton.jit
def _offsets(W, G: tl.constexpr, RA: tl.constexpr):
    """Offsets [G, RA] of a tile from its first position: column g, row r at g + r * G.

    `W >> 31` is 0 (W >= 0) but opaque to Triton's alignment analysis, so loads take one element a
    thread along the columns, the layout of the data-dependent stores and the scans too: no tile
    round-trips through shared memory for a layout change (coalesced either way).
    """
    col = tl.arange(0, G) + (W >> 31)
    return col[:, None] + tl.arange(0, RA)[None, :] * G


@triton.jit
def _load_tile(TP, offs, lim, MASKED: tl.constexpr):
    """Scores of a tile starting at TP; with MASKED, -inf at offsets >= lim."""
    if MASKED:
        x = tl.load(TP + offs, mask=offs < lim, other=float("-inf"))
    else:
        x = tl.load(TP + offs)
    return x


@triton.jit
def _translate(PT_ROW, pt_cols, pt_regs, pos, sel, page_bits, PTB: tl.constexpr):
    """Upstream's page_to_indices: (page_table[pos >> bits] << bits) | (pos & (2^bits - 1)),
    from the prefetched table row when PTB > 0."""
    col = pos >> page_bits
    if PTB > 0:
        page = tl.reshape(tl.gather(pt_regs, tl.reshape(col, [col.numel]), 0), col.shape)
    else:
        page = tl.load(PT_ROW + col, mask=sel & (col < pt_cols), other=0)
    return (page << page_bits) | (pos & ((1 << page_bits) - 1))


@triton.jit
def _naive_row(OUT_ROW, RAW_ROW, PT_ROW, pt_cols, pt_regs, n, page_bits, K: tl.constexpr, PTB: tl.constexpr,
               HAS_RAW: tl.constexpr):
    i = tl.arange(0, K)
    ok = i < n
    idx = tl.where(ok, _translate(PT_ROW, pt_cols, pt_regs, i, ok, page_bits, PTB), -1)
    tl.store(OUT_ROW + i, idx)
    if HAS_RAW:
        tl.store(RAW_ROW + i, tl.where(ok, i, -1))


@triton.jit
def _bound(gmax, L, K: tl.constexpr, SMALL: tl.constexpr):
    """B: a key v with at least K column maxima >= v and at most SMALL in v's final bin."""
    G: tl.constexpr = 2 * K
    valid = tl.arange(0, G) < L
    gk = _keys(gmax.to(tl.int32, bitcast=True))
    kmin = tl.min(tl.where(valid, gk, 0xFFFFFFFF), 0).to(tl.int64)
    lo, w = _radix_start(kmin, tl.max(tl.where(valid, gk, 0), 0).to(tl.int64))
    need = tl.full([], K, tl.int32)
    go = tl.full([], 1, tl.int1)
    while go:
        s = tl.maximum(w - DIGIT, 0)
        lo, w, need, c = _radix_step(_digit_hist(gk, valid, lo, w, s), lo, w, s, need)
        go = (c > SMALL) & (w > 0)
    return lo


@triton.jit
def _compact_block(x, pos, ok, vf, WS, n, CAP: tl.constexpr):
    """C for a [columns, rows] block in output order: every valid score reaching vf, as (fp32 bits
    << 32 | position), to WS[n + its rank in the block, column by column]; slots past CAP all go
    to the spare WS[CAP]. -> the block's count."""
    fl = ok & _reaches(x, vf)
    fi = fl.to(tl.int32)
    cnt = tl.sum(fi, 1)
    slot = tl.minimum(n + (tl.cumsum(cnt, 0) - cnt)[:, None] + tl.cumsum(fi, 1) - fi, CAP)
    val = (x.to(tl.int32, bitcast=True).to(tl.int64) << 32) | pos.to(tl.int64)
    tl.store(WS + slot, val, mask=fl)
    return tl.sum(cnt, 0)


@triton.jit
def _candidates_short(x, offs, L, WS, K: tl.constexpr, SMALL: tl.constexpr, CAP: tl.constexpr):
    """A-C for a row of one tile, `x` its scores in registers. -> (candidate count, bound key v)."""
    v = _bound(tl.max(x, 1), L, K, SMALL)
    n = _compact_block(x, offs, offs < L, _score_at_least(v), WS, 0, CAP)
    return n, v


@triton.jit
def _list_pairs(TMAX, ntiles, vf, PAIRS, W, G: tl.constexpr):
    """The (column, tile) pairs whose tile-column max reaches vf, in (column, tile) order, to PAIRS
    as the pair's first position (tile * 8G + column). -> how many."""
    T: tl.constexpr = G * RT
    col = tl.arange(0, G) + (W >> 31)
    t = tl.arange(0, NTB)[None, :]
    if ntiles <= NTB:  # one step: count and list at once
        ok = t < ntiles
        tm = tl.load(TMAX + t * G + col[:, None], mask=ok, other=0).to(tl.float32, bitcast=True)
        fi = (ok & _reaches(tm, vf)).to(tl.int32)
        cnt = tl.sum(fi, 1)
        slot = (tl.cumsum(cnt, 0) - cnt)[:, None] + tl.cumsum(fi, 1) - fi
        tl.store(PAIRS + slot, t * T + col[:, None], mask=fi != 0)
        m = tl.sum(cnt, 0)
    else:  # count per column first, then list
        cnt = tl.zeros([G], tl.int32)
        for t0 in range(0, ntiles, NTB):
            ok = t0 + t < ntiles
            tm = tl.load(TMAX + (t0 + t) * G + col[:, None], mask=ok, other=0).to(tl.float32, bitcast=True)
            cnt += tl.sum((ok & _reaches(tm, vf)).to(tl.int32), 1)
        base = tl.cumsum(cnt, 0) - cnt
        for t0 in range(0, ntiles, NTB):
            ok = t0 + t < ntiles
            tm = tl.load(TMAX + (t0 + t) * G + col[:, None], mask=ok, other=0).to(tl.float32, bitcast=True)
            fi = (ok & _reaches(tm, vf)).to(tl.int32)
            tl.store(PAIRS + base[:, None] + tl.cumsum(fi, 1) - fi, (t0 + t) * T + col[:, None], mask=fi != 0)
            base += tl.sum(fi, 1)
        m = tl.sum(cnt, 0)
    return m


@triton.jit
def _candidates_long(ROW, L, W, WS, AUX, K: tl.constexpr, SMALL: tl.constexpr, CAP: tl.constexpr):
    """A-C for a row longer than one tile: pass A keeps every (tile, column) max in AUX, then only
    the listed pairs' columns are re-read, PQ pairs ([PQ, RT] scores) at a time."""
    G: tl.constexpr = 2 * K
    T: tl.constexpr = G * RT
    PQ: tl.constexpr = G // 2
    TMAX = AUX
    PAIRS = AUX + tl.cdiv(W, T) * G
    offs = _offsets(W, G, RT)
    cidx = tl.arange(0, G) + (W >> 31)
    gmax = tl.full([G], float("-inf"), tl.float32)
    for base in range(0, L, T):
        if base + T <= L:
            tm = tl.max(_load_tile(ROW + base, offs, L - base, False), 1)
        else:
            tm = tl.max(_load_tile(ROW + base, offs, L - base, True), 1)
        tl.store(TMAX + (base // T) * G + cidx, tm.to(tl.int32, bitcast=True))
        gmax = tl.maximum(gmax, tm)
    v = _bound(gmax, L, K, SMALL)
    vf = _score_at_least(v)
    tl.debug_barrier()  # the tile maxima, before other threads read them back
    m = _list_pairs(TMAX, tl.cdiv(L, T), vf, PAIRS, W, G)
    tl.debug_barrier()  # the pair list, before it is read back
    q = tl.arange(0, PQ) + (W >> 31)
    rows = tl.arange(0, RT)[None, :] * G
    n = L * 0
    for q0 in range(0, m, PQ):
        qv = q0 + q < m
        start = tl.load(PAIRS + q0 + q, mask=qv, other=0)
        pos = start[:, None] + rows
        ok = qv[:, None] & (pos < L)
        n += _compact_block(tl.load(ROW + pos, mask=ok, other=float("-inf")), pos, ok, vf, WS, n, CAP)
    return n, v


@triton.jit
def _emit(key, pos, ok, lo, w, need, n_ab, n_in, OUT_ROW, RAW_ROW, PT_ROW, pt_cols, pt_regs, page_bits,
          PTB: tl.constexpr, HAS_RAW: tl.constexpr):
    """E for a [columns, rows] block of candidates, in output order (column by column): every key
    above the bin [lo, lo + 2^w), and the first `need` inside it, to slot = (above before it) +
    min(in-bin before it, need); n_ab / n_in count the earlier blocks' ones.
    -> this block's (above, in-bin) counts."""
    hi_u = (lo + (1 << w) - 1).to(tl.uint32)
    above = ok & (key > hi_u)
    inbin = ok & (key >= lo.to(tl.uint32)) & (key <= hi_u)
    pk = above.to(tl.int32) + (inbin.to(tl.int32) << 16)  # block < 2^16: both counts in one scan
    cs = tl.sum(pk, 1)
    ex = (tl.cumsum(cs, 0) - cs)[:, None] + tl.cumsum(pk, 1) - pk
    rank_in = n_in + (ex >> 16)
    sel = above | (inbin & (rank_in < need))
    slot = n_ab + (ex & 0xFFFF) + tl.minimum(rank_in, need)
    tl.store(OUT_ROW + slot, _translate(PT_ROW, pt_cols, pt_regs, pos, sel, page_bits, PTB), mask=sel)
    if HAS_RAW:
        tl.store(RAW_ROW + slot, pos, mask=sel)
    tot = tl.sum(cs, 0)
    return tot & 0xFFFF, tot >> 16


@triton.jit
def _select_buffer(WS, n, OUT_ROW, RAW_ROW, PT_ROW, pt_cols, pt_regs, page_bits, K: tl.constexpr,
                   CAP: tl.constexpr, PTB: tl.constexpr, HAS_RAW: tl.constexpr):
    """D + E over the n <= CAP workspace candidates (already in output order)."""
    i = tl.arange(0, CAP) + (n >> 31)  # n >> 31 == 0: one element a thread, as the stores (_offsets)
    ok = i < n
    val = tl.load(WS + i, mask=ok, other=0)
    pos = val.to(tl.int32)
    key = _keys((val >> 32).to(tl.int32))
    kmin = tl.min(tl.where(ok, key, 0xFFFFFFFF), 0).to(tl.int64)
    lo, w = _radix_start(kmin, tl.max(tl.where(ok, key, 0), 0).to(tl.int64))
    need = tl.full([], K, tl.int32)
    go = tl.full([], 1, tl.int1)
    while go:
        s = tl.maximum(w - DIGIT, 0)
        lo, w, need, c = _radix_step(_digit_hist(key, ok, lo, w, s), lo, w, s, need)
        go = (c != need) & (w > 0)
    _emit(key[:, None], pos[:, None], ok[:, None], lo, w, need, 0, 0, OUT_ROW, RAW_ROW, PT_ROW, pt_cols, pt_regs,
          page_bits, PTB, HAS_RAW)


@triton.jit
def _select_row(ROW, L, W, vf, OUT_ROW, RAW_ROW, PT_ROW, pt_cols, pt_regs, page_bits, K: tl.constexpr,
                PTB: tl.constexpr, HAS_RAW: tl.constexpr):
    """D + E straight from the row (more than CAP candidates): same selection, same order."""
    G: tl.constexpr = 2 * K
    lo, w = _radix_start(tl.full([], 0, tl.int64), tl.full([], 0xFFFFFFFF, tl.int64))
    need = tl.full([], K, tl.int32)
    go = tl.full([], 1, tl.int1)
    i0 = tl.arange(0, G) + (W >> 31)
    while go:
        s = tl.maximum(w - DIGIT, 0)
        h = tl.zeros([NBINS], tl.int32)
        for c0 in range(0, L, G):  # histograms do not care about order: plain 1-D blocks
            i = c0 + i0
            x = tl.load(ROW + i, mask=i < L, other=float("-inf"))
            h += _digit_hist(_keys(x.to(tl.int32, bitcast=True)), (i < L) & _reaches(x, vf), lo, w, s)
        lo, w, need, c = _radix_step(h, lo, w, s, need)
        go = (c != need) & (w > 0)
    hi_u = (lo + (1 << w) - 1).to(tl.uint32)
    lo_u = lo.to(tl.uint32)
    offs = _offsets(W, G, 2)  # two rows a step: any row blocking gives the same order here
    c_ab = tl.zeros([G], tl.int32)  # per column: keys above the bin, keys in it
    c_in = tl.zeros([G], tl.int32)
    for base in range(0, L, 2 * G):
        x = _load_tile(ROW + base, offs, L - base, True)
        key = _keys(x.to(tl.int32, bitcast=True))
        ok = (offs < L - base) & _reaches(x, vf)
        c_ab += tl.sum((ok & (key > hi_u)).to(tl.int32), 1)
        c_in += tl.sum((ok & (key >= lo_u) & (key <= hi_u)).to(tl.int32), 1)
    b_ab = tl.cumsum(c_ab, 0) - c_ab  # earlier columns' counts (column-major order)
    b_in = tl.cumsum(c_in, 0) - c_in
    for base in range(0, L, 2 * G):
        x = _load_tile(ROW + base, offs, L - base, True)
        key = _keys(x.to(tl.int32, bitcast=True))
        ok = (offs < L - base) & _reaches(x, vf)
        ab = (ok & (key > hi_u)).to(tl.int32)
        inb = (ok & (key >= lo_u) & (key <= hi_u)).to(tl.int32)
        rank_in = b_in[:, None] + tl.cumsum(inb, 1) - inb
        sel = (ab != 0) | ((inb != 0) & (rank_in < need))
        slot = b_ab[:, None] + tl.cumsum(ab, 1) - ab + tl.minimum(rank_in, need)
        pos = base + offs
        tl.store(OUT_ROW + slot, _translate(PT_ROW, pt_cols, pt_regs, pos, sel, page_bits, 0), mask=sel)
        if HAS_RAW:
            tl.store(RAW_ROW + slot, pos, mask=sel)
        b_ab += tl.sum(ab, 1)
        b_in += tl.sum(inb, 1)


@triton.jit
def topk_transform_kernel(
    SC, stride_sb,  # fp32 scores [B, >= W] (last dim contiguous)
    SEQ,  # int32 [B]
    PT, stride_pb, pt_cols,  # int32 page table [B, pt_cols] (last dim contiguous)
    OUT,  # int32 [B, K] contiguous
    RAW,  # int32 [B, K] contiguous (only with HAS_RAW)
    WS,  # int64 [NPROG, CAP + 1]: candidates (slot CAP takes the overflow)
    AUX,  # int32 [NPROG, 2 * cdiv(W, 8G) * G]: a long row's (tile, column) maxima and pair list
    B, W, page_bits,
    K: tl.constexpr,
    CAP: tl.constexpr,  # candidate slots per program
    SMALL: tl.constexpr,  # B stops once the bin of the K-th column max holds <= SMALL
    SPEC: tl.constexpr,  # load a row's first 2G scores before its seq_len is known
    PTB: tl.constexpr,  # > 0: prefetch the first PTB page-table columns (covers every row)
    HAS_RAW: tl.constexpr,
):
    pid = tl.program_id(0)
    G: tl.constexpr = 2 * K
    WSP = WS + pid.to(tl.int64) * (CAP + 1)
    AUXP = AUX + pid.to(tl.int64) * (2 * tl.cdiv(W, G * RT) * G)
    for b in range(pid, B, tl.num_programs(0)):
        b64 = tl.cast(b, tl.int64)
        ROW = SC + b64 * stride_sb
        PT_ROW = PT + b64 * stride_pb
        OUT_ROW = OUT + b64 * K
        RAW_ROW = RAW + b64 * K
        if SPEC:  # issued together with the seq_len load: short rows wait for one round trip
            x2 = _load_tile(ROW, _offsets(W, G, 2), W, True)
        if PTB > 0:
            pt_i = tl.arange(0, PTB)
            pt_regs = tl.load(PT_ROW + pt_i, mask=pt_i < pt_cols, other=0)
        else:
            pt_regs = pt_cols  # unused
        seq = tl.load(SEQ + b)
        L = tl.minimum(seq, W)
        if L <= K:
            # upstream's short-row branch (it tests seq_len <= K, where it never reads the scores);
            # L < seq only when seq_len > W, rows upstream would read past.
            _naive_row(OUT_ROW, RAW_ROW, PT_ROW, pt_cols, pt_regs, tl.where(seq <= K, seq, L), page_bits, K, PTB,
                       HAS_RAW)
        else:
            # one-tile paths sized to the row (the order is the same: rows past L are empty)
            if L <= G:
                o1 = _offsets(W, G, 1)
                n, v = _candidates_short(_load_tile(ROW, o1, L, True), o1, L, WSP, K, SMALL, CAP)
            elif L <= 2 * G:
                o2 = _offsets(W, G, 2)
                if SPEC:
                    x = tl.where(o2 < L, x2, float("-inf"))
                else:
                    x = _load_tile(ROW, o2, L, True)
                n, v = _candidates_short(x, o2, L, WSP, K, SMALL, CAP)
            elif L <= 4 * G:
                o4 = _offsets(W, G, 4)
                n, v = _candidates_short(_load_tile(ROW, o4, L, True), o4, L, WSP, K, SMALL, CAP)
            else:
                n, v = _candidates_long(ROW, L, W, WSP, AUXP, K, SMALL, CAP)
            tl.debug_barrier()  # the workspace stores above, before any thread reads them
            if n <= CAP:
                _select_buffer(WSP, n, OUT_ROW, RAW_ROW, PT_ROW, pt_cols, pt_regs, page_bits, K, CAP, PTB, HAS_RAW)
            else:
                _select_row(ROW, L, W, _score_at_least(v), OUT_ROW, RAW_ROW, PT_ROW, pt_cols, pt_regs, page_bits,
                            K, PTB, HAS_RAW)
            tl.debug_barrier()  # this row's reads of the workspaces, before the next row's writes
