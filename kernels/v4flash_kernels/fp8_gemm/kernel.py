"""Triton kernels of the 128x128 block-scaled FP8 GEMM (DeepSeek-V4's dense linears) for sm_120 and sm_90.

Format: the weight `B [N, K]` is e4m3 with one fp32 scale per 128x128 block (`BS [ceil(N/128),
ceil(K/128)]`); the activation `A [M, K]` is e4m3 with one fp32 scale per row and 128-column group
(`AS [M, ceil(K/128)]`). `C = sum_g (A_g . B_g^T) * AS[:, g] * BS[n // 128, g]` in fp32, cast once.

* ``gemm_kernel``: one program = one output tile x one contiguous run of 128-wide K groups (split-K).
  ``QUANT_A``: `A` is the unquantized activation (bf16/fp16/fp32) and each program quantizes the
  groups it reads itself (``quant_groups``), so a linear is one launch. Every program quantizing the
  same group computes the same bits, from the same 128 inputs, so this is exactly the separate
  per-token-group quant followed by the GEMM. ``SWAP``: the tile is computed as `B_tile . A_tile^T`
  (the weight fills the MMA's M side; decode rows are few). ``SPLIT``: the programs of a tile write
  fp32 partials, and the last to arrive (an integer ticket; which program that is does not matter)
  sums them in split order 0..S-1, casts, stores and resets the ticket: deterministic, one launch,
  no floating-point atomics, no wait on other programs (no residency requirement).
* ``act_quant_kernel``: the per-token-group quant on its own, for calls large enough that
  re-quantizing a group in every output-column program would cost more than a launch (prefill).

The quant arithmetic is sgl-kernel's `per_token_group_quant_8bit` v2 (what the pinned SGLang runs on
CUDA): ``amax = max(1e-10, max |x|)``, stored scale ``amax * fp32(1/448)``, codes
``e4m3_rn(clamp(x * (448 / amax), -448, 448))`` with an IEEE division. The codes are rounded onto the
e4m3 grid in fp32 first (``round_e4m3``) so the cast itself is exact: the same bits as the hardware
``cvt.rn.satfinite`` on the GPU, and correct under the Triton interpreter, whose fp32 -> e4m3 cast
drops the carry into the next binade (127.7 -> 64).
"""

from __future__ import annotations

import triton
import triton.language as tl

GROUP = tl.constexpr(128)  # quantization group along K (block_size[1]) and the K step of the loop
FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-10)


@triton.jit
def round_e4m3(v):
    """`v` (fp32, |v| <= 448) rounded to nearest-even on the e4m3 grid, as fp32 (sign of zero kept)."""
    bits = v.to(tl.int32, bitcast=True)
    # Normals (|v| >= 2^-6): keep 3 of 23 mantissa bits, ties to even; a carry bumps the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormals (|v| < 2^-6): multiples of 2^-9; adding 1.5 * 2^14 puts the rounding point there.
    sub = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -2147483648)
    return tl.where(tl.abs(v) < 0.015625, sub.to(tl.float32, bitcast=True), normal)


@triton.jit
def quant_groups(x, AXIS: tl.constexpr):
    """One 128-wide group per row (AXIS=1) or per column (AXIS=0) of fp32 `x` -> (e4m3 codes, fp32 scales)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=AXIS), AMAX_FLOOR)
    mult = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    if AXIS == 1:
        v = x * mult[:, None]
    else:
        v = x * mult[None, :]
    q = round_e4m3(tl.clamp(v, -FP8_MAX, FP8_MAX)).to(tl.float8e4nv)
    return q, amax * (1.0 / 448.0)


@triton.jit
def gemm_kernel(
    A, stride_am,  # [M, K] (K contiguous): e4m3, or bf16/fp16/fp32 when QUANT_A
    AS, stride_asm, stride_ask,  # [M, ceil(K/128)] fp32 activation scales (not read when QUANT_A)
    B, stride_bn,  # [N, K] e4m3 (K contiguous)
    BS, stride_bsn, stride_bsk,  # [ceil(N/128), ceil(K/128)] fp32 weight scales
    C, stride_cm,  # [M, N] output (N contiguous)
    WS, CNT,  # SPLIT: fp32 partials [S, M, N] and int32 tickets, one per tile, zero between calls
    M, N, K, groups_per_split,
    QUANT_A: tl.constexpr,
    SWAP: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
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
    if SPLIT:
        tl.store(WS + sid.to(tl.int64) * M * N + w_off, acc, mask=c_mask)
        # The barrier orders this program's partial stores before the release; the acquire and the
        # .cg loads (which skip the non-coherent L1) make every program's partial visible to the last.
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            total = tl.zeros_like(acc)
            part = WS + w_off
            for _ in range(0, tl.num_programs(1)):
                total += tl.load(part, mask=c_mask, other=0.0, cache_modifier=".cg")
                part += M * N
            tl.store(C + c_off, total.to(C.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(CNT + pid, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(C + c_off, acc.to(C.dtype.element_ty), mask=c_mask)


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
