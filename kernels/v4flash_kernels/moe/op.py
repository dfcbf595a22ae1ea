"""Host side of the grouped MXFP4 MoE: config table, planner, graph-safe buffers, the public entry.

`mxfp4_moe_forward` is a drop-in for sglang 0.5.13.post1's
`fused_moe_triton.mxfp4_moe_sm120_triton.mxfp4_moe_forward_triton`: same positional signature and
defaults, same argument semantics (w13 rows `[0, I)` gate and `[I, 2I)` up; two e2m1 values per
byte, the even k in the low nibble; fp32 scales as upstream's loader leaves them, or e8m0 bytes;
`topk_ids` -1 = skip the slot; `clamp_limit` only when > 0; `routed_scaling_factor` only when not
None) and the same return value: a new `[M, hidden]` tensor in the input dtype (`inplace` is
accepted and ignored, as upstream does).

Why a planner and not autotuning: every launch (grid, configs, buffer sizes) must be a function of
shapes only, so a CUDA graph captured once replays correctly for any routing, and every config the
dispatcher can launch must be known ahead of time so `check_sm120` can prove it fits sm_120.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Tuple

import torch
import triton
import triton.language as tl

from v4flash_kernels.moe import kernel as _k


@dataclass(frozen=True)
class GemmConfig:
    """One compiled variant of `gemm_kernel` (block sizes and launch shape)."""

    block_m: int
    block_n: int  # output columns per program (GATED: gate columns; the tile holds 2x rows of w13)
    block_k: int
    num_warps: int
    num_stages: int
    mode: int = 0  # 0: tl.dot(x, w^T); 1: tl.dot(w, x^T); 2: FMA (no tensor cores; tiny M per expert); 3: FMA + prefetch
    split_k: int = 1  # gemm1 only: K split over more programs; GEMM2 then reduces the partials and activates

    @property
    def name(self) -> str:
        tag = {0: "", 1: "_wl", 2: "_fma", 3: "_fmapf"}[self.mode] + (f"_sk{self.split_k}" if self.split_k > 1 else "")
        return f"m{self.block_m}_n{self.block_n}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}{tag}"


@dataclass(frozen=True)
class Plan:
    """How one call is laid out: routing mode and the two GEMMs' configs (pure function of shapes)."""

    inline: bool  # group slots inside the GEMMs (decode) instead of the sorting prep kernels
    gemm1: GemmConfig
    gemm2: GemmConfig

    @property
    def name(self) -> str:
        return f"{'inline' if self.inline else 'sorted'}/g1:{self.gemm1.name}/g2:{self.gemm2.name}"


# Every GEMM config the planner may launch; check_sm120 cross-compiles each (GATED for gemm1
# entries, plain for gemm2 entries) for sm_120 and sm_90.
# H200, 2026-11-30 (kernels/BENCH.md, bench_moe --quick): the prefill GEMM1 tile follows the mean
# rows per expert (M=1024 -> 24: 32-row blocks best; M=4096 -> 96: 128-row blocks best); GEMM2's
# 64x64 tile won at both.
DECODE_G1 = GemmConfig(16, 16, 256, 4, 3)
DECODE_G1_ONE_STAGE = GemmConfig(16, 16, 256, 4, 1)  # sorted, >= 96 slots: W bytes straight to registers
DECODE_G2 = GemmConfig(16, 32, 128, 2, 3)
PREFILL_G1_SMALL = GemmConfig(32, 64, 128, 4, 3)
PREFILL_G1 = GemmConfig(64, 64, 64, 4, 3)
PREFILL_G1_LARGE = GemmConfig(128, 64, 64, 8, 3)
PREFILL_G2 = GemmConfig(64, 64, 64, 4, 3)
GEMM1_CONFIGS: Tuple[GemmConfig, ...] = (DECODE_G1, DECODE_G1_ONE_STAGE, PREFILL_G1_SMALL, PREFILL_G1,
                                          PREFILL_G1_LARGE)
GEMM2_CONFIGS: Tuple[GemmConfig, ...] = (DECODE_G2, PREFILL_G2)

def launchable() -> Tuple[Tuple[GemmConfig, bool, bool], ...]:
    """(config, GATED, INLINE) of every GEMM binary the planner can launch (for check_sm120)."""
    return ((DECODE_G1, True, True), (DECODE_G2, False, True), (DECODE_G2, False, False)) + tuple(
        (c, True, False) for c in GEMM1_CONFIGS) + ((PREFILL_G2, False, False),)


# Inline grouping costs O(slots) per program and registers; the sorting prep ~6 us (three small
# launches). H200 (bench_moe --quick, 2026-11-30): inline 4.6 us faster at M=1; sorted 8 % faster
# at M=4 and 1.2-1.5x at M=16/64 (the inline programs' routing prologue and registers). M=2 is
# not measured: inline up to 12 slots. GEMM1 with one stage (no cp.async staging of the W bytes)
# was 8-9 % faster at M=16/64 and 14 % slower at M=4; GEMM2 with 2 warps 4-15 % faster at all four.
INLINE_MAX_SLOTS = 12
ONE_STAGE_MIN_SLOTS = 96
DECODE_MAX_ROWS_PER_EXPERT = 4  # up to this many rows per expert on average: 16-row decode tiles
PREP_CHUNK = 128
PREP_SCAN_CB = 32
PREP_SCAN_BB = 64
COMBINE_BLOCK = 1024
COMBINE_NUM_WARPS = 4


def make_plan(tokens: int, topk: int, num_experts: int, hidden: int, inter: int) -> Plan:
    """Inline grouping with decode tiles for small calls, sorted row blocks for prefill."""
    slots = tokens * topk
    if slots <= INLINE_MAX_SLOTS:
        return Plan(True, DECODE_G1, DECODE_G2)
    rows_per_expert = slots / max(1, num_experts)
    if rows_per_expert <= DECODE_MAX_ROWS_PER_EXPERT:
        return Plan(False, DECODE_G1 if slots < ONE_STAGE_MIN_SLOTS else DECODE_G1_ONE_STAGE, DECODE_G2)
    if rows_per_expert <= 32:
        g1 = PREFILL_G1_SMALL
    elif rows_per_expert <= 64:
        g1 = PREFILL_G1
    else:
        g1 = PREFILL_G1_LARGE
    return Plan(False, g1, PREFILL_G2)


def fit_block_k(cfg: GemmConfig, kd: int) -> int:
    """Largest block_k <= cfg.block_k dividing the reduction length (>= 32: one scale group)."""
    bk = cfg.block_k
    while bk > 32 and kd % bk:
        bk //= 2
    return bk


def max_blocks(slots: int, experts: int, block_m: int) -> int:
    """Upper bound on row blocks after padding every expert's slot list to block_m."""
    return int(triton.cdiv(slots + min(experts, slots) * (block_m - 1), block_m))


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _work_dtype() -> torch.dtype:
    """bf16 intermediates on the GPU; fp32 under the interpreter, whose fp32->bf16 cast truncates
    (three truncations in a row would bias CPU tests by ~0.8 %)."""
    return torch.float32 if _interpret() else torch.bfloat16


def _scale_view(scale: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """(tensor the kernel reads, its SCALE_MODE) for a scale tensor as the drop-in receives it.

    Upstream's function converts every non-fp32 scale with `.to(torch.float32)`: float8_e8m0fnu
    bytes become 2^(b - 127), any other dtype (uint8, int8, bf16, ...) is taken *by value*. The
    same here: e8m0 bytes are decoded exactly in the kernel (no copy), other dtypes are converted
    as upstream does, and fp32 values of any kind are multiplied in exactly (SCALE_F32). The fast
    exponent-only decode is never chosen from a tensor's dtype: only a repacked layer whose scales
    were range-checked at load time takes it.
    """
    if scale.dtype == torch.float32:
        s, mode = scale, _k.SCALE_F32
    elif scale.dtype == torch.float8_e8m0fnu:
        s, mode = scale.view(torch.uint8), _k.SCALE_E8M0
    else:
        s, mode = scale.to(torch.float32), _k.SCALE_F32
    if s.stride(-1) != 1:
        s = s.contiguous()
    return s, mode


def _weight_view(w: torch.Tensor) -> torch.Tensor:
    u = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    return u if u.stride(-1) == 1 else u.contiguous()


def _launch_gemm(cfg: Any, grid: Any, a: Any, w: Any, s: Any, s_mode: Any, out: Any, ids: Any, tw: Any, sorted_: Any,
                 blk_e: Any, blk_r: Any, slots: Any, n: Any, kd: Any, a_div: Any,
                 clamp: Any, scaling: Any, gated: Any, inline: Any, block_s: Any, stride_ap: int = 0, split_k: int = 1,
                 a_parts: int = 0, nibbles: int = 0) -> None:
    bk = fit_block_k(cfg, kd // split_k)
    _k.gemm_kernel[grid](
        a, a.stride(0), w, w.stride(0), w.stride(1), s, s.stride(0), s.stride(1),
        out, out.stride(0), ids, tw, sorted_, blk_e, blk_r,
        slots, n, kd, a_div,
        float(clamp) if clamp is not None else 0.0, float(scaling),
        GATED=gated, HAS_CLAMP=clamp is not None, INLINE=inline, BLOCK_S=block_s,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, SCALE_MODE=s_mode,
        DEQ_ASM=not _interpret(), DOT_DTYPE=tl.float32 if _interpret() else tl.bfloat16,
        stride_ap=stride_ap, SPLIT_K=split_k, A_PARTS=a_parts,
        MODE=cfg.mode, NIBBLES=nibbles, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def run(
    hidden_states: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    intermediate_size: int,
    routed_scaling_factor: float | None = None,
    clamp_limit: float | None = None,
    plan: Plan | None = None,
    out: torch.Tensor | None = None,
    fast_scales: bool = False,
    nibbles: int = 0,
) -> torch.Tensor:
    """The MoE forward with an optional explicit plan (the benchmark sweeps plans through this).

    `out` ([M, hidden], input dtype) may be given so tests can poison it and prove every element
    is written. `fast_scales`: both scale tensors are uint8 e8m0 bytes that `repack.check_scales`
    accepted (a `repack.RepackedExperts`), read with the exponent-only decode. `nibbles=1`: the
    weights are in `repack.PAIR_SPLIT` order (a repacked layer; needs `fast_scales` and a plan of
    tensor-core GEMMs, modes 0-1, without split-K), 0: the loader's.
    """
    M, K = hidden_states.shape
    E = w13_packed.shape[0]
    I = int(intermediate_size)  # noqa: E741
    topk = topk_ids.shape[1]
    dev = hidden_states.device
    if K % 32 or I % 32:
        raise ValueError(f"MXFP4 needs hidden and intermediate sizes divisible by 32 (got {K}, {I})")
    if tuple(w13_packed.shape) != (E, 2 * I, K // 2) or tuple(w2_packed.shape) != (E, K, I // 2):
        raise ValueError(f"bad MXFP4 weight shapes w13 {tuple(w13_packed.shape)} w2 {tuple(w2_packed.shape)} "
                         f"for hidden {K}, intermediate {I}")
    if out is None:
        out = torch.empty((M, K), dtype=hidden_states.dtype, device=dev)
    S = M * topk
    if S == 0:
        return out
    if plan is None:
        plan = make_plan(M, topk, E, K, I)
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    w13, w2 = _weight_view(w13_packed), _weight_view(w2_packed)
    if nibbles == 1:
        bad = [c.name for c in (plan.gemm1, plan.gemm2) if c.mode > 1 or c.split_k > 1]
        if not fast_scales or bad:
            raise ValueError(f"PAIR_SPLIT weights (nibbles=1) need fast_scales and tensor-core GEMMs without "
                             f"split-K (fast_scales={fast_scales}, refused configs: {bad})")
        w13, w2 = w13.view(torch.int32), w2.view(torch.int32)  # the kernel reads whole PAIR_SPLIT words
    elif nibbles != 0:
        raise ValueError(f"nibbles must be 0 (the loader's order) or 1 (PAIR_SPLIT), got {nibbles}")
    if fast_scales:
        if w13_scale.dtype != torch.uint8 or w2_scale.dtype != torch.uint8:
            raise ValueError("fast_scales needs the checked uint8 e8m0 bytes of a RepackedExperts")
        (s13, m13), (s2, m2) = (w13_scale, _k.SCALE_FAST), (w2_scale, _k.SCALE_FAST)
    else:
        s13, m13 = _scale_view(w13_scale)
        s2, m2 = _scale_view(w2_scale)
    clamp = float(clamp_limit) if clamp_limit is not None and clamp_limit > 0 else None
    scaling = float(routed_scaling_factor) if routed_scaling_factor is not None else 1.0

    g1, g2 = plan.gemm1, plan.gemm2
    sk = g1.split_k
    if sk > 1:  # fp32 gate/up partials per K split; GEMM2 sums them and activates
        inter = torch.empty((sk, S, 2 * I), dtype=torch.float32, device=dev)
    else:
        inter = torch.empty((S, I), dtype=_work_dtype(), device=dev)
    down = torch.empty((S, K), dtype=_work_dtype(), device=dev)
    if plan.inline:
        nb1 = nb2 = S
        block_s = triton.next_power_of_2(S)
        sorted1 = blk_e1 = blk_r1 = sorted2 = blk_e2 = blk_r2 = ids
    else:
        block_s = 1
        sorted1, blk_e1, blk_r1, nb1 = _sort_slots(ids, S, E, g1.block_m)
        if g2.block_m == g1.block_m:
            sorted2, blk_e2, blk_r2, nb2 = sorted1, blk_e1, blk_r1, nb1
        else:
            sorted2, blk_e2, blk_r2, nb2 = _sort_slots(ids, S, E, g2.block_m)
    inter2d = inter[0] if sk > 1 else inter
    _launch_gemm(g1, (nb1, triton.cdiv(I, g1.block_n), sk), x, w13, s13, m13, inter2d, ids, tw,
                 sorted1, blk_e1, blk_r1, S, I, K, topk, clamp, 1.0, True, plan.inline, block_s,
                 stride_ap=S * 2 * I, split_k=sk, nibbles=nibbles)
    _launch_gemm(g2, (nb2, triton.cdiv(K, g2.block_n)), inter2d, w2, s2, m2, down, ids, tw,
                 sorted2, blk_e2, blk_r2, S, K, I, 1, clamp if sk > 1 else None, scaling, False, plan.inline,
                 block_s, stride_ap=S * 2 * I, a_parts=sk if sk > 1 else 0, nibbles=nibbles)
    _k.combine_kernel[(M, triton.cdiv(K, COMBINE_BLOCK))](
        down, ids, out, out.stride(0), K, TOPK=topk, BLOCK=COMBINE_BLOCK, num_warps=COMBINE_NUM_WARPS,
    )
    return out


def _sort_slots(ids: torch.Tensor, S: int, E: int, block_m: int) -> Any:
    """Counting sort of slots by expert into block_m-row blocks (three launches, shapes-only sizes)."""
    dev = ids.device
    nch = triton.cdiv(S, PREP_CHUNK)
    nb = max_blocks(S, E, block_m)
    e_p2 = triton.next_power_of_2(E)
    hist = torch.empty((nch, E), dtype=torch.int32, device=dev)
    rank = torch.empty((S,), dtype=torch.int32, device=dev)
    offs = torch.empty((E,), dtype=torch.int32, device=dev)
    blk_e = torch.empty((nb,), dtype=torch.int32, device=dev)
    blk_r = torch.empty((nb,), dtype=torch.int32, device=dev)
    sorted_ = torch.empty((nb * block_m,), dtype=torch.int32, device=dev)
    _k.hist_kernel[(nch,)](ids, hist, rank, S, E, CHUNK=PREP_CHUNK, E_P2=e_p2, num_warps=8)
    _k.scan_kernel[(1,)](hist, offs, blk_e, blk_r, nch, E, nb, BLOCK_M=block_m, E_P2=e_p2,
                         CB=PREP_SCAN_CB, BB=PREP_SCAN_BB, num_warps=8)
    _k.scatter_kernel[(nch,)](ids, hist, rank, offs, sorted_, S, E, CHUNK=PREP_CHUNK, num_warps=4)
    return sorted_, blk_e, blk_r, nb


def mxfp4_moe_forward(
    hidden_states: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    hidden_size: int,
    intermediate_size: int,
    inplace: bool = False,
    routed_scaling_factor: float | None = None,
    clamp_limit: float | None = None,
) -> torch.Tensor:
    """Routed-expert MLP over MXFP4 weights; same contract as upstream `mxfp4_moe_forward_triton`.

    `hidden_size` is accepted for compatibility (the hidden size is read from `hidden_states`,
    as upstream does); `inplace` is ignored, as upstream does.
    """
    return run(
        hidden_states, w13_packed, w2_packed, w13_scale, w2_scale, topk_ids, topk_weights,
        intermediate_size, routed_scaling_factor=routed_scaling_factor, clamp_limit=clamp_limit,
    )
