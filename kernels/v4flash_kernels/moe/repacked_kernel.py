"""Triton GEMM of the MXFP4 MoE decode path (v2), for layers repacked at load time (`moe.repack`).

Why a second GEMM: v1 (`kernel.gemm_kernel`) puts tokens in the MMA's M dimension (16-row tiles of
which 1-2 rows are real at decode sizes) and decodes FP4 in a blocked layout, so each k-step sends
the packed bytes, their bf16 copy and the padded activation tile through shared memory. Here:

* **Swap AB**: the weight tile is the MMA's left operand, ``acc[BLOCK_N, BLOCK_T] += W[BLOCK_N,
  BLOCK_K] @ X^T``, so the padded dimension is the MMA's N (8 or 16 tokens), not 16 rows of 16.
  With ``BLOCK_T = 8`` Triton emits ``mma.sync`` m16n8k16 on sm_120 and on sm_90 alike.
* **Packed words straight into the MMA fragments**: the weight tile is loaded as 32-bit words
  (``cp.async`` into the software pipeline's ring when ``num_stages > 1``) and read back directly in
  the dot-operand layout; the FP4 decode runs there, in registers. The repacked nibble order
  (``repack.PAIR_SPLIT``: each word holds 8 consecutive k, the even ones in its low 16 bits, the odd
  ones in its high 16 bits) puts the two values of each bf16 pair (k, k+1) exactly 16 bits apart,
  so one mask, one multiply and one mask build a whole 32-bit MMA fragment register (both values'
  exponent/mantissa and sign bits at once), and one ``mul.rn.bf16x2`` applies the scale: ~4
  instructions per fragment register, no byte extraction. The eight values of a word are joined
  back into k order (`pairsplit.decode_words`; v1's prefill tiles use the same decode) and the
  tile is one ``tl.dot`` over its whole k range; no bf16 copy of W exists anywhere. (The decode
  chain must stay elementwise from the load to the dot, the scale broadcast over its 32 weights
  by ``broadcast_to``/``reshape``, for Triton to put the layout conversion on the loaded words;
  ``check_sm120`` keeps the result honest: no spills.)
* **uint8 e8m0 scales**, range-checked at load time (``kernel.SCALE_FAST``): the scale becomes the
  bf16 multiplier ``2^(byte - 64)`` of the same ``mul.rn.bf16x2``; the missing ``2^63`` is applied
  to the fp32 accumulator.

Routing (grouping slots by expert) is v1's, with ``BLOCK_T`` rows per group chunk: *inline* for
small calls (program j owns slot j's expert if j is its first slot) or the block table of the
sorting prep kernels. Grids and buffers depend on shapes only (CUDA-graph safe); every sum has a
fixed order (deterministic: split-K's arrival counter only decides which program reduces).
"""

from __future__ import annotations

import triton
import triton.language as tl

from v4flash_kernels.moe.kernel import SHIFT, swiglu
from v4flash_kernels.moe.pairsplit import decode_words


@triton.jit
def mma_gemm_kernel(
    A,  # GATED: hidden [M, KD] (row = slot // A_DIV); else h [S, KD] (row = slot); last dim contiguous
    stride_am,
    W,  # int32 words [E, rows, KD/8] in repack.PAIR_SPLIT order: w13 rows [0, N) gate, [N, 2N) up; w2 [0, N)
    stride_we,
    stride_wn,
    SC,  # uint8 e8m0 [E, rows, KD/32], every byte in [FAST_MIN_BYTE, FAST_MAX_BYTE]
    stride_se,
    stride_sn,
    OUT,  # GATED: h [S, N]; else the weighted slot rows [S, N]
    stride_om,
    IDS,  # int32 [S] flat topk_ids (-1 = skip)
    TW,  # topk weights [S] (not GATED)
    SORTED,  # int32 [NB * BLOCK_T] slot of each sorted row (not INLINE)
    BLK_E,  # int32 [NB] expert of each row block, -1 past the end (not INLINE)
    BLK_R,  # int32 [NB] valid rows of each block (not INLINE)
    S,
    N,  # output columns: I (GATED) or hidden
    KD,  # reduction length
    A_DIV,  # topk (GATED: A row = token), 1 for w2
    clamp_limit,
    out_scale,
    GATED: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    INLINE: tl.constexpr,
    BLOCK_S: tl.constexpr,  # power of two >= S (INLINE)
    BLOCK_T: tl.constexpr,  # token rows per chunk: the MMA's N (8 or 16)
    BLOCK_N: tl.constexpr,  # W rows per program (GATED: BLOCK_N / 2 gate + BLOCK_N / 2 up rows)
    BLOCK_K: tl.constexpr,
    DEQ_ASM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    WS=None,  # SPLIT_K > 1: fp32 [SPLIT_K, S, 2N] partial tiles (gate/up interleaved as in the tile)
    CNT=None,  # SPLIT_K > 1: int32 [grid 0 * grid 1] arrival counters, zero between calls
    SPLIT_K: tl.constexpr = 1,  # GATED only: K split over grid axis 2; the last split to finish reduces
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_t = tl.arange(0, BLOCK_T)

    if INLINE:
        e = tl.load(IDS + pid_b)
        offs_s = tl.arange(0, BLOCK_S)
        ids = tl.load(IDS + offs_s, mask=offs_s < S, other=-1)
        match = ids == e
        earlier = tl.sum((match & (offs_s < pid_b)).to(tl.int32), axis=0)
        count = tl.sum(match.to(tl.int32), axis=0)
        rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
        n_chunks = tl.where((e >= 0) & (earlier == 0), tl.cdiv(count, BLOCK_T), 0)
    else:
        e = tl.load(BLK_E + pid_b)
        count = tl.load(BLK_R + pid_b)
        n_chunks = tl.where(e >= 0, 1, 0)
    e64 = tl.maximum(e, 0).to(tl.int64)

    offs_w = tl.arange(0, BLOCK_N)
    if GATED:
        col = pid_n * (BLOCK_N // 2) + offs_w // 2
        wrow = (offs_w % 2) * N + col  # gate row n, up row N + n, interleaved
    else:
        col = pid_n * BLOCK_N + offs_w
        wrow = col
    w_ok = col < N
    G: tl.constexpr = BLOCK_K // 32
    w_ptr = W + e64 * stride_we + wrow.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    s_ptr = SC + e64 * stride_se + wrow.to(tl.int64)[:, None] * stride_sn + tl.arange(0, G)[None, :]
    offs_k = tl.arange(0, BLOCK_K)

    for c in range(0, n_chunks):
        if INLINE:
            hit = match[None, :] & (rank[None, :] == (c * BLOCK_T + offs_t)[:, None])
            slot = tl.sum(tl.where(hit, offs_s[None, :], 0), axis=1)
            row_ok = (c * BLOCK_T + offs_t) < count
        else:
            row_ok = offs_t < count
            slot = tl.load(SORTED + pid_b * BLOCK_T + offs_t, mask=row_ok, other=0)
        a_ptr = A + (slot // A_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        k_lo = tl.multiple_of(pid_k * (KD // SPLIT_K), BLOCK_K)
        for k0 in range(k_lo, k_lo + KD // SPLIT_K, BLOCK_K):
            wd = tl.load(w_ptr + k0 // 8, mask=w_ok[:, None], other=0)
            sc = tl.load(s_ptr + k0 // 32, mask=w_ok[:, None], other=0)
            x = tl.load(a_ptr + k0, mask=row_ok[:, None], other=0.0)
            w = decode_words(wd, sc, BLOCK_N, BLOCK_K, DEQ_ASM, DOT_DTYPE)
            acc = tl.dot(w, tl.trans(x.to(DOT_DTYPE)), acc)
        res = tl.trans(acc) * SHIFT  # [BLOCK_T, BLOCK_N]
        if GATED:
            last = True
            if SPLIT_K > 1:
                # Split-K without a second launch: each split stores its fp32 tile, then counts in;
                # the split that arrives last (all other tiles visible after its acquire) sums the
                # tiles in split order (deterministic), activates, and zeroes the counter for the
                # next call / graph replay. The barrier puts this CTA's stores before the release.
                # Callers guarantee one row chunk per program (tokens <= BLOCK_T, or sorted blocks).
                wcol = pid_n * BLOCK_N + offs_w
                ws_row = WS + slot.to(tl.int64)[:, None] * (2 * N) + wcol[None, :]
                ws_ok = row_ok[:, None] & w_ok[None, :]
                plane = S.to(tl.int64) * (2 * N)
                tl.store(ws_row + pid_k * plane, res, mask=ws_ok)
                tl.debug_barrier()
                cnt_ptr = CNT + pid_b * tl.num_programs(1) + pid_n
                arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
                last = arrived == SPLIT_K - 1
                if last:
                    res = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
                    for p in tl.static_range(SPLIT_K):
                        res += tl.load(ws_row + p * plane, mask=ws_ok, other=0.0, cache_modifier=".cg")
                    tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
            if last:
                gate, up = tl.split(tl.reshape(res, [BLOCK_T, BLOCK_N // 2, 2]))
                ocol = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                h = swiglu(gate, up, clamp_limit, HAS_CLAMP)
                optr = OUT + slot.to(tl.int64)[:, None] * stride_om + ocol[None, :]
                tl.store(optr, h.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (ocol < N)[None, :])
        else:
            tw = tl.load(TW + slot, mask=row_ok, other=0.0).to(tl.float32) * out_scale
            ocol = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            optr = OUT + slot.to(tl.int64)[:, None] * stride_om + ocol[None, :]
            tl.store(optr, (res * tw[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None] & (ocol < N)[None, :])
