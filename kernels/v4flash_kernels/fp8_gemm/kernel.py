"""Triton kernels of the 128x128 block-scaled FP8 GEMM (DeepSeek-V4's dense linears) for sm_120 and sm_90.

Format: the weight `B [N, K]` is e4m3 with one fp32 scale per 128x128 block (`BS [ceil(N/128),
ceil(K/128)]`); the activation `A [M, K]` is e4m3 with one fp32 scale per row and 128-column group
(`AS [M, ceil(K/128)]`). `C = sum_g (A_g . B_g^T) * AS[:, g] * BS[n // 128, g]` in fp32, cast once.

Only what `op`'s plan launches is here (the experiments the plan was chosen from are in `v4flash_bench.fp8_candidates`):

* ``gemv_kernel`` (1-4 rows, the linear only): no tensor cores. Each program issues ONE load of its
  whole weight tile `[BLOCK_N, K]` (all its bytes in flight at once: what a latency-bound decode
  GEMM needs; padded MMA rows would cost nothing here but the MMA's shapes force tiles and splits),
  quantizes the activation rows itself, converts e4m3 -> fp32 on the CUDA cores and reduces each row
  against the tile. Whole K per program: no split, no fix-up, one launch.
* ``gemm_kernel``: one program = one output tile x one contiguous run of 128-wide K groups (split-K).
  ``QUANT_A``: `A` is the unquantized activation (bf16/fp16/fp32) and each program quantizes the
  groups it reads itself (``quant_groups``), so a linear is one launch. Every program quantizing the
  same group computes the same bits, from the same 128 inputs, so this is exactly the separate
  per-token-group quant followed by the GEMM. ``SWAP``: the tile is computed as `B_tile . A_tile^T`
  (the weight fills the MMA's M side; decode rows are few). ``FIXUP`` of a split K: ``ticket``: the
  programs of a tile write fp32 partials and the last to arrive (an integer ticket; which program
  that is does not matter) sums them in split order 0..S-1 with all S loads issued at once, casts,
  stores and resets the ticket: one launch, no floating-point atomics, no wait on other programs
  (no residency requirement). ``partials``: the programs only write their partials and
  ``reduce_kernel`` (a second launch) sums them: for splits whose partials are too many bytes for
  one program to read (the planner's `TICKET_MAX_ELEMS`). Both deterministic.
* ``act_quant_kernel``: the per-token-group quant on its own, for the tiles that do not fuse it
  (64-row tiles: re-quantizing a group in every output-column program costs more than a launch).

The quant arithmetic is sgl-kernel's `per_token_group_quant_8bit` v2 (what the pinned SGLang runs on
CUDA): ``amax = max(1e-10, max |x|)``, stored scale ``amax * fp32(1/448)``, codes
``e4m3_rn(clamp(x * (448 / amax), -448, 448))`` with an IEEE division. The codes are rounded onto the
e4m3 grid in fp32 first (``round_e4m3``) so the cast itself is exact: the same bits as the hardware
``cvt.rn.satfinite`` on the GPU, and correct under the Triton interpreter, whose fp32 -> e4m3 cast
drops the carry into the next binade (127.7 -> 64). All three kernels that quantize call
``quant_groups``, so fused and separate quant are the same function.
"""

from __future__ import annotations

import triton
import triton.language as tl

from v4flash_kernels.kit.e4m3 import GROUP, quant_groups

FIXUP_WHOLE = tl.constexpr(0)  # no split: the program stores its tile
FIXUP_TICKET = tl.constexpr(1)  # split: the last-arriving program of a tile sums the partials
FIXUP_PARTIALS = tl.constexpr(2)  # split: partials only, `reduce_kernel` sums them


@triton.jit
def gemv_kernel(
    X, stride_xm,  # [M, K] bf16/fp16/fp32 activation (K contiguous), quantized here
    B, stride_bn,  # [N, K] e4m3 (K contiguous)
    BS, stride_bsn, stride_bsk,  # [ceil(N/128), K/128] fp32 weight scales
    C, stride_cm,  # [M, N] output (N contiguous)
    M, N,
    BM: tl.constexpr,  # rows handled: a power of 2 >= M (<= 4)
    BLOCK_N: tl.constexpr,  # weight rows per program; divides 128, so one weight-scale row per program
    K: tl.constexpr,  # the whole K (a power of 2, a multiple of 128): one program reads all of it
):
    """Grid (ceil(N / BLOCK_N),): `C[:, tile] = quant(X) . dequant(B[tile])^T`, the weight tile in one load."""
    G: tl.constexpr = K // GROUP
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # All of this program's weight bytes are requested before anything else happens. Wrapped rows
    # (N not a multiple of BLOCK_N) keep every load in bounds; they are never stored.
    w = tl.load(B + (offs_n % N).to(tl.int64)[:, None] * stride_bn + tl.arange(0, K)[None, :])
    gs = tl.arange(0, G)
    bs = tl.load(BS + ((pid * BLOCK_N) // GROUP) * stride_bsn + gs * stride_bsk)
    kk = gs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, 128]: group g's columns
    if BM == 1:
        q, a_s = quant_groups(tl.load(X + kk).to(tl.float32), 1)
        a = tl.reshape(q.to(tl.float32) * (a_s * bs)[:, None], (K,))
        # converted here, after the quant's reductions, so the fp32 copy of the tile is never all live
        acc = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        tl.store(C + offs_n, acc.to(C.dtype.element_ty), mask=n_ok)
    else:  # every row quantized first, then one [BM, BLOCK_N, K] product reduced over K
        rm = tl.arange(0, BM)
        r_ok = rm < M
        x = tl.load(X + rm[:, None, None] * stride_xm + kk[None, :, :], mask=r_ok[:, None, None] & (kk >= 0)[None, :, :],
                    other=0.0)
        q, a_s = quant_groups(x.to(tl.float32), 2)
        a = tl.reshape(q.to(tl.float32) * (a_s * bs[None, :])[:, :, None], (BM, K))
        acc = tl.sum(w.to(tl.float32)[None, :, :] * a[:, None, :], axis=2)  # [BM, BLOCK_N]
        tl.store(C + rm[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def gemm_kernel(
    A, stride_am,  # [M, K] (K contiguous): e4m3, or bf16/fp16/fp32 when QUANT_A
    AS, stride_asm, stride_ask,  # [M, ceil(K/128)] fp32 activation scales (not read when QUANT_A)
    B, stride_bn,  # [N, K] e4m3 (K contiguous)
    BS, stride_bsn, stride_bsk,  # [ceil(N/128), ceil(K/128)] fp32 weight scales
    C, stride_cm,  # [M, N] output (N contiguous)
    WS, stride_ws, CNT,  # split: fp32 partials [S, M, N] (stride_ws = M * N); ticket: int32 tickets, one
                         # per tile, zero between calls
    M, N, K, groups_per_split,
    QUANT_A: tl.constexpr,
    SWAP: tl.constexpr,
    FIXUP: tl.constexpr,  # FIXUP_WHOLE / FIXUP_TICKET / FIXUP_PARTIALS
    SP: tl.constexpr,  # ticket: a power of 2 >= the split count (the partial loads are unrolled)
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n_split = tl.num_programs(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped indices: every load is in bounds without a mask; wrapped rows/columns are never stored.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, GROUP)
    g0 = sid * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, tl.cdiv(K, GROUP))
    k0 = g0 * GROUP
    if SWAP:  # operands as [BLOCK_N, 128] (weight) and [128, BLOCK_M] (activation)
        b_ptrs = B + cols[:, None] * stride_bn + (k0 + offs_k)[None, :]
        a_ptrs = A + rows[None, :] * stride_am + (k0 + offs_k)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:  # operands as [BLOCK_M, 128] (activation) and [128, BLOCK_N] (weight)
        b_ptrs = B + cols[None, :] * stride_bn + (k0 + offs_k)[:, None]
        a_ptrs = A + rows[:, None] * stride_am + (k0 + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    as_ptrs = AS + rows * stride_asm + g0 * stride_ask
    bs_ptrs = BS + (cols // GROUP) * stride_bsn + g0 * stride_bsk

    for g in range(g0, g1):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - g * GROUP
            if SWAP:
                a = tl.load(a_ptrs, mask=k_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        b_s = tl.load(bs_ptrs)
        if QUANT_A:
            if SWAP:
                a, a_s = quant_groups(a.to(tl.float32), 0)
            else:
                a, a_s = quant_groups(a.to(tl.float32), 1)
        else:
            a_s = tl.load(as_ptrs)
        # Upstream's per-element order: (dot * a_scale) * b_scale, added to the fp32 accumulator.
        if SWAP:
            acc += tl.dot(b, a) * a_s[None, :] * b_s[:, None]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += GROUP
        b_ptrs += GROUP
        as_ptrs += stride_ask
        bs_ptrs += stride_bsk

    if SWAP:
        c_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        c_off = offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
        w_off = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    else:
        c_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        c_off = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        w_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if FIXUP == FIXUP_WHOLE:
        tl.store(C + c_off, acc.to(C.dtype.element_ty), mask=c_mask)
    else:
        tl.store(WS + sid.to(tl.int64) * stride_ws + w_off, acc, mask=c_mask)
        if FIXUP == FIXUP_TICKET:
            # The barrier orders this program's partial stores before the release; the acquire and
            # the .cg loads (which skip the non-coherent L1) make every program's partial visible to
            # the last. Its S loads are independent (unrolled to SP, masked), so they overlap.
            tl.debug_barrier()
            ticket = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
            if ticket == n_split - 1:
                total = tl.zeros_like(acc)
                part = WS + w_off
                for s in tl.static_range(SP):
                    total += tl.load(part, mask=c_mask & (s < n_split), other=0.0, cache_modifier=".cg")
                    part += stride_ws
                tl.store(C + c_off, total.to(C.dtype.element_ty), mask=c_mask)
                tl.atomic_xchg(CNT + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def reduce_kernel(WS, C, stride_cm, total, N, S, SP: tl.constexpr, BLOCK: tl.constexpr):
    """`C[m, n] = sum_s WS[s, m, n]` (`total` = M * N) for the FIXUP_PARTIALS launch: all S partials of
    BLOCK outputs in one load, summed by a fixed tree over s (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    s = tl.arange(0, SP)
    part = tl.load(WS + s[:, None].to(tl.int64) * total + offs[None, :], mask=(s < S)[:, None] & ok[None, :],
                   other=0.0)
    acc = tl.sum(part, axis=0)
    tl.store(C + (offs // N) * stride_cm + offs % N, acc.to(C.dtype.element_ty), mask=ok)


@triton.jit
def act_quant_kernel(
    X, stride_xm,  # [M, K] bf16/fp16/fp32, K contiguous, K a multiple of 128
    Q, stride_qm,  # [M, K] e4m3 codes
    S, stride_sm,  # [M, K/128] fp32 scales (row-major)
    M,
    BLOCK_R: tl.constexpr,
):
    """Grid (ceil(M / BLOCK_R), K / 128): one [BLOCK_R, 128] block of groups per program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    r_ok = rows < M
    r64 = rows.to(tl.int64)
    cols = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(X + r64[:, None] * stride_xm + cols[None, :], mask=r_ok[:, None], other=0.0)
    q, s = quant_groups(x.to(tl.float32), 1)
    tl.store(Q + r64[:, None] * stride_qm + cols[None, :], q, mask=r_ok[:, None])
    tl.store(S + r64 * stride_sm + g, s, mask=r_ok)
