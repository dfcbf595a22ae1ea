"""Triton kernel of the lightning-indexer logits (fp8 paged MQA logits), one fused pass.

Grid `(NPROG, B)`: program `p` of row `b` walks that row's *valid* tiles `p, p + NPROG, ...`
(a tile = PAGES pages of 64 positions) and then writes -inf over its share of the row's tail.
NPROG comes from shapes only, the loop bounds from `seq_lens` in device memory, so one CUDA graph
replays for any length while the work done follows the actual length, not the page-table width.

Per tile: the fp8 keys `[64*PAGES, 128]` times the fp8 q of all heads `[128, BLOCK_H]` through one
`tl.dot`, ReLU, the head-weighted sum, then the per-token fp32 key scale. The dot takes both
operands as fp16 (every e4m3 value is exact in fp16, their products exact in fp32) with fp32
accumulation, i.e. upstream's fp32 bmm to rounding: fp8 tensor-core MMAs may accumulate with fewer
bits (Hopper's fp8 wgmma does by default), and the kernel is bound by memory, not by the MMA.

Only what a shipped config launches lives here; the measured-and-dropped register prefetch (keys
one tile ahead) is in kernels/scripts/indexer_variants.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

PAGE = tl.constexpr(64)
HEAD_DIM = tl.constexpr(128)
SCALE_OFFSET_F32 = tl.constexpr(64 * 128 // 4)  # the 64 fp32 scales start 8192 bytes into a page


@triton.jit
def _fix_page(page, num_pages):
    # torch-style negative ids (upstream gathers with them); out-of-pool ids are clamped so a bad
    # table cannot fault (upstream would raise a device-side index error instead).
    page = page.to(tl.int64)
    page = tl.where(page < 0, page + num_pages, page)
    return tl.minimum(tl.maximum(page, 0), num_pages - 1)


@triton.jit
def _load_keys(K8, KS, stride_kp8, stride_kps, page, pos, valid):
    """Issue the loads of one tile's fp8 keys [TILE, 128] and fp32 scales [TILE]."""
    slot = pos % PAGE
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(K8 + page[:, None] * stride_kp8 + slot[:, None] * HEAD_DIM + d[None, :],
                mask=valid[:, None], other=0.0)
    sc = tl.load(KS + page * stride_kps + SCALE_OFFSET_F32 + slot, mask=valid, other=0.0)
    return k, sc


@triton.jit
def _store_logits(out_row, k, sc, q, w, pos, valid, max_seq_len, DOT_F16: tl.constexpr):
    """ReLU(k . q_h) weighted over heads, times the key scale; -inf where not valid."""
    if DOT_F16:
        s = tl.dot(k.to(tl.float16), q)
    else:
        s = tl.dot(k.to(tl.float32), q, input_precision="ieee")
    s = tl.maximum(s, 0.0) * w[None, :]
    logit = tl.sum(s, axis=1)
    tl.store(out_row + pos, tl.where(valid, logit * sc, float("-inf")), mask=pos < max_seq_len)


@triton.jit
def indexer_logits_kernel(
    Q, stride_qb, stride_qh,  # fp8 q [B, 1, H, 128] (last dim contiguous)
    K8, KS, stride_kp8, stride_kps,  # the pool as fp8 and as fp32, page strides in elements
    W, stride_wb, stride_wh,  # weights [B, H], any float dtype
    SEQ, stride_sb,  # seq_lens [B], int32 or int64
    PT, stride_pb,  # page table [B, >= max_pages], int32 or int64
    OUT, stride_ob,  # fp32 logits [B, max_seq_len]
    H, max_seq_len, num_pages,
    BLOCK_H: tl.constexpr,
    PAGES: tl.constexpr,
    FILL: tl.constexpr,
    DOT_F16: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    b = tl.program_id(1).to(tl.int64)
    TILE: tl.constexpr = PAGES * PAGE
    t_off = tl.arange(0, TILE)
    out_row = OUT + b * stride_ob
    pt_row = PT + b * stride_pb

    # One round trip for everything that does not depend on the length: seq_len, q, weights and the
    # page ids of this program's first tile (read speculatively inside the table's max_pages columns).
    seq = tl.load(SEQ + b * stride_sb)
    pos = pid * TILE + t_off
    page = tl.load(pt_row + pos // PAGE, mask=pos < max_seq_len, other=0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    hmask = h < H
    q = tl.load(Q + b * stride_qb + h[None, :] * stride_qh + d[:, None], mask=hmask[None, :], other=0.0)
    w = tl.load(W + b * stride_wb + h * stride_wh, mask=hmask, other=0.0).to(tl.float32)
    q = q.to(tl.float16) if DOT_F16 else q.to(tl.float32)
    n = tl.minimum(tl.maximum(seq, 0), max_seq_len).to(tl.int32)
    n_tiles = tl.cdiv(n, TILE)

    for t in range(pid, n_tiles, nprog):
        pos = t * TILE + t_off
        valid = pos < n
        if t != pid:
            page = tl.load(pt_row + pos // PAGE, mask=valid, other=0)
        k, sc = _load_keys(K8, KS, stride_kp8, stride_kps, _fix_page(page, num_pages), pos, valid)
        _store_logits(out_row, k, sc, q, w, pos, valid, max_seq_len, DOT_F16)

    # -inf over [n_tiles * TILE, max_seq_len): the tail past the last valid tile
    tail0 = n_tiles * TILE
    n_fill = tl.cdiv(tl.maximum(max_seq_len - tail0, 0), FILL)
    f_off = tl.arange(0, FILL)
    neg = tl.full((FILL,), float("-inf"), tl.float32)
    for f in range(pid, n_fill, nprog):
        pos_f = tail0 + f * FILL + f_off
        tl.store(out_row + pos_f, neg, mask=pos_f < max_seq_len)
