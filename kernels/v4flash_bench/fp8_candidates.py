"""Experiment-only kernels and launches for the small-M sweep (`python -m v4flash_bench.fp8_sweep`); none of this ships.

Why they exist: the sweep measures the design space around the shipped kernels on the GPU before
the plan table changes: the data picks, and only then does a candidate move into `kernel.py`/`op.py`
(with check_sm120 and the CPU/GPU tests). Promoted from the first H200 sweep: the whole-K GEMV
(fused quant, no PDL) as `kernel.gemv_kernel`, and the ``ticket`` / ``reduce`` fix-ups (KG = 1) into
`kernel.gemm_kernel` / `kernel.reduce_kernel`; PDL, split GEMVs, KG = 2, the ``serial`` fix-up and
the other tiles stay here. Families:

* ``gemv_kernel`` (M <= 4): no tensor cores. Each program issues ONE load of its whole weight tile
  `[BLOCK_N, KCHUNK]` (16-byte vector loads along K; all its bytes in flight at once, the thing a
  latency-bound decode GEMM needs), converts e4m3 -> fp32 on the CUDA cores and reduces each
  activation row against it (FMA; padded MMA rows cost nothing here). `KCHUNK = K` is split-free
  (more, narrower N tiles instead); `KCHUNK < K` splits K with a fix-up: ``ticket`` (the last
  program of a tile sums all partials with ONE load of `[S, BLOCK_N]`, not S dependent loads) or
  ``reduce`` (partials only, then `reduce_kernel`, a second launch). ``PDL``: programmatic dependent
  launch (weights are loaded before `gdc_wait`, the activation after).
* ``dot_kernel``: the shipped `gemm_kernel` (tensor-core `tl.dot`, swap-AB option, fused quant)
  plus ``KG`` scale groups per step (BLOCK_K = 128 x KG: more bytes per pipeline stage) and the
  same three fix-ups: ``serial`` (as shipped: S dependent loads), ``ticket`` (unrolled, independent
  loads), ``reduce`` (second launch).
* ``null_kernel`` / ``stream_kernel``: calibration. A launch that does nothing, and one that only
  reads the weight with a GEMV grid: the floor of one call in this timing method (graph of r calls,
  weights rotated past L2), to judge how far any candidate can still go.

Arithmetic: `C[m, n] = sum_k W[n, k] * (q[m, k] * (AS[m, g] * BS[n // 128, g]))` in fp32 on the
CUDA cores (gemv), or `(dot * AS) * BS` per group (dot, as shipped); both are fp32-exact to well
inside the bench's strict bound against the fp64 reference, and the quant is the shipped
`quant_groups` (bit for bit the definition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

import torch
import triton
import triton.language as tl

from v4flash_kernels.fp8_gemm import op
from v4flash_kernels.kit.e4m3 import AMAX_FLOOR, FP8_MAX, GROUP, quant_groups, round_e4m3

MODES = {"whole": 0, "ticket": 1, "reduce": 2, "serial": 3}


@triton.jit
def gemv_kernel(
    A, stride_am,  # [M, K]: bf16/fp16/fp32 (QUANT_A) or e4m3 codes
    AS, stride_asm,  # [M, K/128] fp32 row-major (not read when QUANT_A)
    B, stride_bn,  # [N, K] e4m3
    BS, stride_bsn,  # [N/128, K/128] fp32
    C, stride_cm,  # [M, N]
    WS, CNT,  # fp32 partials [S, M, N], int32 tickets (MODE ticket/reduce)
    M, N,
    QUANT_A: tl.constexpr,
    MODE: tl.constexpr,  # 0 whole K, 1 split + last-program fix-up, 2 split + partials only
    BM: tl.constexpr,  # rows handled (>= M, a power of 2)
    BLOCK_N: tl.constexpr,  # divides 128: one weight-scale row per program
    KCHUNK: tl.constexpr,  # K per program (K % KCHUNK == 0)
    SP: tl.constexpr,  # power of 2 >= the split count
    PDL: tl.constexpr,
):
    G: tl.constexpr = KCHUNK // GROUP
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n_split = tl.num_programs(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k0 = sid * KCHUNK
    offs_k = k0 + tl.arange(0, KCHUNK)
    # All of this program's weight bytes are requested before anything else happens.
    w = tl.load(B + (offs_n % N).to(tl.int64)[:, None] * stride_bn + offs_k[None, :])
    gs = sid * G + tl.arange(0, G)
    bs = tl.load(BS + ((pid * BLOCK_N) // GROUP) * stride_bsn + gs)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the activation, workspace and tickets belong to the previous grid until now
    kk = k0 + tl.arange(0, G)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, 128]
    if BM == 1:
        if QUANT_A:
            x = tl.load(A + kk).to(tl.float32)
            q, a_s = quant_groups(x, 1)
        else:
            q = tl.load(A + kk)
            a_s = tl.load(AS + gs)
        a = tl.reshape(q.to(tl.float32) * (a_s * bs)[:, None], (KCHUNK,))
        # converted here, after the quant's barriers, so the fp32 copy of the tile is never all live
        acc = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        if MODE == 0:
            tl.store(C + offs_n, acc.to(C.dtype.element_ty), mask=n_ok)
        else:
            tl.store(WS + sid.to(tl.int64) * N + offs_n, acc, mask=n_ok)
    else:  # every row quantized first, then one [BM, BLOCK_N, KCHUNK] product reduced over K
        rm = tl.arange(0, BM)
        r_ok = rm < M
        x_ptrs = A + rm[:, None, None] * stride_am + kk[None, :, :]
        x_ok = r_ok[:, None, None] & (kk >= 0)[None, :, :]
        if QUANT_A:
            x = tl.load(x_ptrs, mask=x_ok, other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=2), AMAX_FLOOR)  # kernel.quant_groups, per row
            mult = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
            q = round_e4m3(tl.clamp(x * mult[:, :, None], -FP8_MAX, FP8_MAX))
            a_s = amax * (1.0 / 448.0)
        else:
            q = tl.load(x_ptrs, mask=x_ok, other=0.0).to(tl.float32)
            a_s = tl.load(AS + rm[:, None] * stride_asm + gs[None, :], mask=r_ok[:, None] & (gs >= 0)[None, :],
                          other=0.0)
        a = tl.reshape(q * (a_s * bs[None, :])[:, :, None], (BM, KCHUNK))
        acc = tl.sum(w.to(tl.float32)[None, :, :] * a[:, None, :], axis=2)  # [BM, BLOCK_N]
        o_ok = r_ok[:, None] & n_ok[None, :]
        if MODE == 0:
            tl.store(C + rm[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty), mask=o_ok)
        else:
            tl.store(WS + (sid * M + rm).to(tl.int64)[:, None] * N + offs_n[None, :], acc, mask=o_ok)
    if MODE == 1:
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == n_split - 1:
            s = tl.arange(0, SP)
            for m in tl.static_range(BM):
                ok = (s < n_split)[:, None] & (n_ok & (m < M))[None, :]
                part = tl.load(WS + (s[:, None] * M + m).to(tl.int64) * N + offs_n[None, :], mask=ok, other=0.0,
                               cache_modifier=".cg")
                tl.store(C + m * stride_cm + offs_n, tl.sum(part, axis=0).to(C.dtype.element_ty),
                         mask=n_ok & (m < M))
            tl.atomic_xchg(CNT + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def reduce_kernel(WS, C, stride_cm, M, N, S, SP: tl.constexpr, BLOCK: tl.constexpr):
    """C[m, n] = sum_s WS[s, m, n] (a fixed tree over s: deterministic), BLOCK outputs per program."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    ok = offs < total
    s = tl.arange(0, SP)
    part = tl.load(WS + s[:, None].to(tl.int64) * total + offs[None, :], mask=(s < S)[:, None] & ok[None, :], other=0.0)
    acc = tl.sum(part, axis=0)
    tl.store(C + (offs // N) * stride_cm + offs % N, acc.to(C.dtype.element_ty), mask=ok)


@triton.jit
def dot_kernel(
    A, stride_am, AS, stride_asm, stride_ask, B, stride_bn, BS, stride_bsn, stride_bsk, C, stride_cm, WS, CNT,
    M, N, K, groups_per_split,
    QUANT_A: tl.constexpr,
    SWAP: tl.constexpr,
    MODE: tl.constexpr,  # 0 whole, 1 ticket (unrolled loads), 2 partials only (reduce_kernel), 3 ticket (serial loads)
    KG: tl.constexpr,  # 128-wide scale groups per step (groups_per_split % KG == 0)
    SP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """`kernel.gemm_kernel` (K % 128 == 0) with KG groups per step and a choice of split-K fix-up."""
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
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, GROUP)
    g0 = sid * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, K // GROUP)
    k0 = g0 * GROUP
    if SWAP:
        b_ptrs = B + cols[:, None] * stride_bn + (k0 + offs_k)[None, :]
        a_ptrs = A + rows[None, :] * stride_am + (k0 + offs_k)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        b_ptrs = B + cols[None, :] * stride_bn + (k0 + offs_k)[:, None]
        a_ptrs = A + rows[:, None] * stride_am + (k0 + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    as_ptrs = AS + rows * stride_asm + g0 * stride_ask
    bs_ptrs = BS + (cols // GROUP) * stride_bsn + g0 * stride_bsk
    for _ in range(g0, g1, KG):
        for j in tl.static_range(KG):
            a = tl.load(a_ptrs + j * GROUP)
            b = tl.load(b_ptrs + j * GROUP)
            b_s = tl.load(bs_ptrs + j * stride_bsk)
            if QUANT_A:
                if SWAP:
                    a, a_s = quant_groups(a.to(tl.float32), 0)
                else:
                    a, a_s = quant_groups(a.to(tl.float32), 1)
            else:
                a_s = tl.load(as_ptrs + j * stride_ask)
            if SWAP:
                acc += tl.dot(b, a) * a_s[None, :] * b_s[:, None]
            else:
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += KG * GROUP
        b_ptrs += KG * GROUP
        as_ptrs += KG * stride_ask
        bs_ptrs += KG * stride_bsk
    if SWAP:
        c_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        c_off = offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
        w_off = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    else:
        c_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        c_off = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        w_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if MODE == 0:
        tl.store(C + c_off, acc.to(C.dtype.element_ty), mask=c_mask)
    else:
        tl.store(WS + sid.to(tl.int64) * M * N + w_off, acc, mask=c_mask)
    if MODE == 1 or MODE == 3:
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == n_split - 1:
            total = tl.zeros_like(acc)
            if MODE == 1:
                for s in tl.static_range(SP):
                    total += tl.load(WS + s * M * N + w_off, mask=c_mask & (s < n_split), other=0.0,
                                     cache_modifier=".cg")
            else:
                part = WS + w_off
                for _ in range(0, n_split):
                    total += tl.load(part, mask=c_mask, other=0.0, cache_modifier=".cg")
                    part += M * N
            tl.store(C + c_off, total.to(C.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(CNT + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def null_kernel(C):
    """Calibration: one launch that does (almost) nothing."""
    if tl.program_id(0) == 1 << 30:
        tl.store(C, 0.0)


@triton.jit
def stream_kernel(B, stride_bn, C, N, BLOCK_N: tl.constexpr, KCHUNK: tl.constexpr):
    """Calibration: read a [BLOCK_N, KCHUNK] weight tile per program (one load) and store an integer sum."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * KCHUNK + tl.arange(0, KCHUNK)
    w = tl.load(B + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :])
    tot = tl.sum(w.to(tl.int8, bitcast=True).to(tl.int32), axis=1)
    tl.store(C + tl.program_id(1) * N + offs_n, tot.to(tl.float32))


# ----------------------------------------------------------------------------- host side


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class Gemv:
    block_n: int
    kchunk: int  # 0 = the whole K (no split)
    num_warps: int
    mode: str = "ticket"  # fix-up when split: "ticket" or "reduce"
    fuse_quant: bool = True
    pdl: bool = False

    @property
    def name(self) -> str:
        k = "K" if self.kchunk == 0 else f"k{self.kchunk}_{self.mode}"
        return (f"gemv_n{self.block_n}_{k}_w{self.num_warps}" + ("" if self.fuse_quant else "_sepq")
                + ("_pdl" if self.pdl else ""))


@dataclass(frozen=True)
class Dot:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    swap: bool
    fuse_quant: bool
    mode: str = "ticket"  # "whole" (no split), "ticket", "reduce", "serial" (the shipped fix-up)
    kg: int = 1
    ctas_per_sm: int = 2
    max_split: int = 64
    group_m: int = 8

    @property
    def name(self) -> str:
        fix = "whole" if self.mode == "whole" else f"{self.mode}c{self.ctas_per_sm}"
        return (f"dot_m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"
                + ("_swap" if self.swap else "") + ("_fq" if self.fuse_quant else "_sepq")
                + (f"_kg{self.kg}" if self.kg > 1 else "") + f"_{fix}")


def dot_split(cfg: Dot, m: int, n: int, k: int, sms: int) -> int:
    """Programs per tile along K (each a whole number of KG-group steps): ~ctas_per_sm x SMs programs."""
    if cfg.mode == "whole":
        return 1
    steps = k // op.GROUP // cfg.kg
    tiles = op.cdiv(m, cfg.block_m) * op.cdiv(n, cfg.block_n)
    want = min(cfg.max_split, steps, (cfg.ctas_per_sm * sms) // max(1, tiles))
    if want < 2:
        return 1
    return op.cdiv(steps, op.cdiv(steps, want))


def _quant(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return op.quantize_activation(x)


def run_gemv(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, cfg: Gemv) -> torch.Tensor:
    """The linear `x @ dequant(w)^T` through `gemv_kernel` (K % kchunk == 0, 128 % block_n == 0)."""
    m, k = x.shape
    n = w.shape[0]
    kchunk = cfg.kchunk or k
    assert k % kchunk == 0 and kchunk % op.GROUP == 0 and op.GROUP % cfg.block_n == 0 and m <= 4
    split = k // kchunk
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if cfg.fuse_quant:
        a, a_s = x, ws  # a_s not read
    else:
        a, a_s = _quant(x)
    tiles = op.cdiv(n, cfg.block_n)
    mode = 0 if split == 1 else MODES[cfg.mode]
    wsp = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = op.tickets(x.device, tiles) if mode == 1 else out
    extra = {"launch_pdl": True} if cfg.pdl else {}
    gemv_kernel[(tiles, split)](
        a, a.stride(0), a_s, a_s.stride(0), w, w.stride(0), ws, ws.stride(0), out, out.stride(0), wsp, cnt, m, n,
        QUANT_A=cfg.fuse_quant, MODE=mode, BM=_pow2(m), BLOCK_N=cfg.block_n, KCHUNK=kchunk, SP=_pow2(split),
        PDL=cfg.pdl, num_warps=cfg.num_warps, num_stages=1, **extra)
    if mode == 2:
        _reduce(wsp, out)
    return out


def _reduce(wsp: torch.Tensor, out: torch.Tensor) -> None:
    s, m, n = wsp.shape
    block = 256
    reduce_kernel[(op.cdiv(m * n, block),)](wsp, out, out.stride(0), m, n, s, SP=_pow2(s), BLOCK=block, num_warps=4)


def run_dot(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, cfg: Dot, sms: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    assert k % (op.GROUP * cfg.kg) == 0
    split = dot_split(cfg, m, n, k, sms)
    steps = k // op.GROUP // cfg.kg
    per = op.cdiv(steps, split) * cfg.kg
    split = op.cdiv(k // op.GROUP, per)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = op.cdiv(m, cfg.block_m) * op.cdiv(n, cfg.block_n)
    mode = 0 if split == 1 else {"ticket": 1, "reduce": 2, "serial": 3}[cfg.mode]
    wsp = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = op.tickets(x.device, tiles) if mode in (1, 3) else out
    if cfg.fuse_quant:
        a, a_s = x, ws
        sam, sak = 0, 0
    else:
        a, a_s = _quant(x)
        sam, sak = a_s.stride(0), a_s.stride(1)
    dot_kernel[(tiles, split)](
        a, a.stride(0), a_s, sam, sak, w, w.stride(0), ws, ws.stride(0), ws.stride(1), out, out.stride(0), wsp, cnt,
        m, n, k, per, QUANT_A=cfg.fuse_quant, SWAP=cfg.swap, MODE=mode, KG=cfg.kg, SP=_pow2(split),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if mode == 2:
        _reduce(wsp, out)
    return out


def run_null(out: torch.Tensor) -> torch.Tensor:
    null_kernel[(1,)](out)
    return out


def run_stream(w: torch.Tensor, block_n: int, kchunk: int) -> torch.Tensor:
    n, k = w.shape
    out = torch.empty((k // kchunk, n), dtype=torch.float32, device=w.device)
    stream_kernel[(n // block_n, k // kchunk)](w, w.stride(0), out, n, BLOCK_N=block_n, KCHUNK=kchunk,
                                               num_warps=4 if block_n * kchunk <= 16384 else 8)
    return out


# ----------------------------------------------------------------------------- what the sweep times


def gemv_tiles(n: int, k: int, sms: int) -> List[Tuple[int, int]]:
    """(block_n, kchunk) pairs with 8-32 KB of weight per program and ~1-4.5 programs per SM."""
    out = []
    for bn in (4, 8, 16, 32, 64):
        for kc in (512, 1024, 2048, 4096):
            if kc > k or k % kc or n % bn:
                continue
            tile, progs = bn * kc, (n // bn) * (k // kc)
            if 8192 <= tile <= 32768 and 0.9 * sms <= progs <= 4.5 * sms:
                out.append((bn, kc))
    return out


def gemv_candidates(m: int, n: int, k: int, sms: int) -> List[Gemv]:
    """At M = 1 the wide set; at M = 2..4 the anchors only (the same questions, fewer compiles)."""
    tiles = gemv_tiles(n, k, sms)
    whole = [(bn, kc) for bn, kc in tiles if kc == k]
    split = [(bn, kc) for bn, kc in tiles if kc < k and kc <= 1024]
    warps = {t: (4 if t[0] * t[1] <= 16384 else 8) for t in tiles}
    out: List[Gemv] = []
    for t in whole:
        out.append(Gemv(t[0], 0, warps[t]))
    for t in split if m == 1 else split[:2]:
        out.append(Gemv(t[0], t[1], warps[t]))
    if whole:  # the anchor: flip warps, separate quant, PDL
        t = whole[-1] if m == 1 else whole[0]
        if m == 1:
            out.append(Gemv(t[0], 0, 12 - warps[t]))
        out.append(Gemv(t[0], 0, warps[t], fuse_quant=False))
        out.append(Gemv(t[0], 0, warps[t], pdl=True))
    if split:  # the same tile, fixed up by a second launch instead of the last program
        t = split[-1]
        out.append(Gemv(t[0], t[1], warps[t], mode="reduce"))
    return out


def dot_candidates(m: int) -> List[Dot]:
    if m <= 4:  # next to the GEMV: the shipped DECODE tile with each fix-up, and two groups per step
        return [
            Dot(16, 128, 4, 2, True, True, "ticket"),
            Dot(16, 128, 4, 2, True, True, "reduce"),
            Dot(16, 128, 4, 3, True, True, "ticket", kg=2),
        ]
    if m <= 16:
        return [
            Dot(16, 128, 4, 2, True, True, "ticket"),  # DECODE with the unrolled fix-up
            Dot(16, 128, 4, 2, True, True, "reduce"),
            Dot(16, 64, 4, 2, True, True, "ticket"),
            Dot(16, 128, 4, 3, True, True, "ticket", kg=2),
            Dot(16, 128, 4, 2, True, False, "ticket"),
            Dot(16, 128, 4, 4, True, True, "ticket", ctas_per_sm=1),
            Dot(16, 128, 8, 2, True, True, "ticket"),
        ]
    return [
        Dot(64, 64, 4, 2, False, True, "ticket"),  # MEDIUM with the unrolled fix-up
        Dot(64, 128, 4, 3, False, False, "ticket", group_m=32),  # LARGE with the unrolled fix-up
        Dot(64, 128, 4, 3, False, False, "reduce", group_m=32),
        Dot(64, 128, 4, 3, False, False, "whole", group_m=32),  # upstream's tiling, our quant
        Dot(64, 64, 4, 3, False, False, "ticket"),
        Dot(64, 128, 4, 4, False, False, "ticket", ctas_per_sm=1),
        Dot(64, 128, 4, 2, False, False, "ticket", kg=2),
        Dot(64, 128, 8, 3, False, False, "ticket"),
        Dot(64, 128, 4, 3, True, False, "ticket"),  # swap: 128 weight rows on the MMA's M side
    ]


def sweep_variants(m: int, n: int, k: int, sms: int) -> List[Tuple[str, Callable[..., Any]]]:
    """(name, fn(x, w, ws) -> out) for every candidate at this (M, N, K)."""
    out: List[Tuple[str, Callable[..., Any]]] = []
    if m <= 4:
        out += [(c.name, lambda x, w, s, c=c: run_gemv(x, w, s, c)) for c in gemv_candidates(m, n, k, sms)]
    out += [(c.name, lambda x, w, s, c=c: run_dot(x, w, s, c, sms)) for c in dot_candidates(m)]
    return out


def calibration_variants(n: int, k: int, sms: int) -> List[Tuple[str, Callable[..., Any]]]:
    """Not a GEMM: an empty launch, and a weight-only read with two GEMV grids (no fix-up)."""
    tiles = gemv_tiles(n, k, sms)
    pick = sorted({t for t in tiles if t[1] == k} or set(tiles[:1]))[:2]
    out: List[Tuple[str, Callable[..., Any]]] = [("cal_null", lambda x, w, s: run_null(torch.empty(1, device=w.device)))]
    out += [(f"cal_stream_n{bn}_k{kc}", lambda x, w, s, bn=bn, kc=kc: run_stream(w, bn, kc)) for bn, kc in pick]
    return out
