"""Host side of the MoE forward on repacked experts: v2 decode plans, buffers, the public entry.

`moe_forward_repacked(hidden_states, experts, topk_ids, topk_weights, routed_scaling_factor,
clamp_limit)` computes exactly what `op.mxfp4_moe_forward` (and upstream's
`mxfp4_moe_forward_triton`) computes for the same layer, from a `repack.RepackedExperts`:

* decode sizes (up to `V2_MAX_ROWS_PER_EXPERT` rows per expert on average) run the v2 GEMMs
  (`repacked_kernel.mma_gemm_kernel`: swap-AB MMA, FP4 words decoded in the MMA fragments, uint8 scales);
* larger calls run v1's prefill GEMM (`kernel.gemm_kernel` through `op.run`) on the same words
  (`nibbles=1`: each k-step's words are decoded into k order with `pairsplit.decode_word_groups`,
  so the activation tile is contracted as loaded) with the exponent-only scale decode, which the
  repack's check made exact. Its tiles are `prefill_plan`'s, not the drop-in's `op.make_plan`.

Plans are pure functions of shapes (graph-safe: one captured graph replays correctly for any
routing); every config either path can launch is in `launchable()` for `check_sm120`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import torch
import triton
import triton.language as tl

from v4flash_kernels.kit.device import arrival_counters
from v4flash_kernels.moe import kernel as _k
from v4flash_kernels.moe import op as _v1
from v4flash_kernels.moe import repacked_kernel as _k2
from v4flash_kernels.moe.repack import RepackedExperts


@dataclass(frozen=True)
class MmaConfig:
    """One compiled variant of `mma_gemm_kernel`."""

    block_t: int  # token rows per chunk (the MMA's N: 8 or 16)
    block_n: int  # W rows per program (GATED: half gate, half up); 16 per warp
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # gemm1 only: K split over more programs; gemm2 then sums the partials and activates

    @property
    def name(self) -> str:
        sk = f"_sk{self.split_k}" if self.split_k > 1 else ""
        return f"t{self.block_t}_n{self.block_n}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}{sk}"


@dataclass(frozen=True)
class PlanV2:
    """A v2 decode call: routing mode and the two GEMMs' configs (pure function of shapes)."""

    inline: bool
    gemm1: MmaConfig
    gemm2: MmaConfig

    @property
    def name(self) -> str:
        return f"v2-{'inline' if self.inline else 'sorted'}/g1:{self.gemm1.name}/g2:{self.gemm2.name}"


Plan = PlanV2 | _v1.Plan  # a v1 Plan runs v1's GEMMs with the fast scale decode

# Config table. 16 W rows per warp (the MMA's M); shared memory at 3-4 stages stays far below
# sm_120's 99 KB (check_sm120 proves each entry). Chosen from the generated code (no spills, the
# FP4 decode in the MMA fragments) before any GPU run; `bench --quick` sweeps the alternatives
# (v4flash_bench.moe.v2_candidates) so the table can follow the measurement.
G1_T8 = MmaConfig(8, 64, 256, 4, 3)
G1_T8_SK4 = MmaConfig(8, 64, 256, 4, 3, split_k=4)  # M=1: 6 experts x 16 row blocks is 96 programs; x4
G2_T8 = MmaConfig(8, 64, 256, 4, 3)
G1_T16 = MmaConfig(16, 64, 256, 4, 3)
G2_T16 = MmaConfig(16, 64, 256, 4, 3)

# Prefill (v1's GEMM on PAIR_SPLIT words, `nibbles=1`): the drop-in's row-block tiles (`op.make_plan`
# picks them by mean rows per expert, measured on the H200 for the loader's order). Operand order
# per tile, from the generated code (not yet measured; `bench --prefill` times both for each tile):
# the 8-warp 128-row tile runs one CTA per SM, so there W is the MMA's left operand (mode 1): on
# sm_90 the decoded tile is then wgmma's register operand, issued asynchronously (the next k-step's
# decode overlaps it) with one CTA barrier per k-step instead of three. The 4-warp tiles keep
# several CTAs per SM, which overlap each other anyway; there mode 0 keeps the leaner k-step on
# sm_90 (32-row: mma.sync as v1 was measured with, 637 instructions and 2 CTA barriers per k-step
# against 604 and 4 for mode 1, whose scales take a trip through shared memory; 64-row: 271
# against 335 instructions).
PF_G1_SMALL = _v1.GemmConfig(32, 64, 128, 4, 3)
PF_G1 = _v1.GemmConfig(64, 64, 64, 4, 3)
PF_G1_LARGE = _v1.GemmConfig(128, 64, 64, 8, 3, mode=1)
PF_G2 = _v1.GemmConfig(64, 64, 64, 4, 3)
PF_SMALL_MAX_ROWS = 32  # mean rows per expert up to which GEMM1 uses 32-row tiles (as op.make_plan)
PF_MEDIUM_MAX_ROWS = 64  # ... 64-row tiles; above, 128-row tiles

INLINE_MAX_SLOTS = 12  # as v1: the inline grouping's O(slots) scan per program stays cheap
SPLIT_MAX_SLOTS = 8  # up to here (M=1 at top-6) GEMM1 splits K: too few row blocks to fill the GPU
T8_MAX_ROWS_PER_EXPERT = 2.5  # mean rows per expert up to which the 8-token MMA tile is used
V2_MAX_ROWS_PER_EXPERT = 8  # above this, v1's prefill GEMMs (16-128-row tiles) take over


def make_plan(tokens: int, topk: int, num_experts: int, hidden: int, inter: int) -> Plan:
    """v2 for decode sizes (8- or 16-token MMA tiles), v1's prefill plan beyond."""
    slots = tokens * topk
    rows = slots / max(1, num_experts)
    if rows > V2_MAX_ROWS_PER_EXPERT:
        return prefill_plan(tokens, topk, num_experts, hidden, inter)
    if slots <= INLINE_MAX_SLOTS:
        return PlanV2(True, G1_T8_SK4 if slots <= SPLIT_MAX_SLOTS else G1_T8, G2_T8)
    if rows <= T8_MAX_ROWS_PER_EXPERT:
        return PlanV2(False, G1_T8, G2_T8)
    return PlanV2(False, G1_T16, G2_T16)


def prefill_plan(tokens: int, topk: int, num_experts: int, hidden: int, inter: int) -> _v1.Plan:
    """v1's sorted row-block GEMMs on the PAIR_SPLIT words, GEMM1's tile by mean rows per expert."""
    rows = tokens * topk / max(1, num_experts)
    if rows <= PF_SMALL_MAX_ROWS:
        g1 = PF_G1_SMALL
    elif rows <= PF_MEDIUM_MAX_ROWS:
        g1 = PF_G1
    else:
        g1 = PF_G1_LARGE
    return _v1.Plan(False, g1, PF_G2)


def launchable() -> Tuple[Tuple[MmaConfig, bool, bool], ...]:
    """(config, GATED, INLINE) of every v2 binary the planner can launch (for check_sm120);
    the v1 configs of the prefill plans are in `op.launchable()` (compiled with SCALE_FAST too)."""
    return ((G1_T8_SK4, True, True), (G1_T8, True, True), (G2_T8, False, True), (G1_T8, True, False),
            (G2_T8, False, False), (G1_T16, True, False), (G2_T16, False, False))


def launchable_v1() -> Tuple[Tuple[_v1.GemmConfig, bool, bool], ...]:
    """(config, GATED, INLINE) of the v1 binaries `make_plan` hands large calls to (sorted, reading
    PAIR_SPLIT words with NIBBLES=1 and the repacked uint8 scales with SCALE_FAST)."""
    return ((PF_G1_SMALL, True, False), (PF_G1, True, False), (PF_G1_LARGE, True, False), (PF_G2, False, False))


def fit_block_k(cfg: MmaConfig, kd: int) -> int:
    """Largest block_k <= cfg.block_k dividing the reduction length (>= 32: one scale group)."""
    bk = cfg.block_k
    while bk > 32 and kd % bk:
        bk //= 2
    return bk


def _launch(cfg: MmaConfig, grid: Any, a: Any, w: Any, s: Any, out: Any, ids: Any, tw: Any, sorted_: Any, blk_e: Any,
            blk_r: Any, slots: Any, n: Any, kd: Any, a_div: Any,
            clamp: Any, scaling: Any, gated: Any, inline: Any, block_s: Any, ws: Any = None, cnt: Any = None,
            split_k: int = 1) -> None:
    interp = _v1._interpret()
    _k2.mma_gemm_kernel[grid](
        a, a.stride(0), w, w.stride(0), w.stride(1), s, s.stride(0), s.stride(1),
        out, out.stride(0), ids, tw, sorted_, blk_e, blk_r,
        slots, n, kd, a_div,
        float(clamp) if clamp is not None else 0.0, float(scaling),
        GATED=gated, HAS_CLAMP=clamp is not None, INLINE=inline, BLOCK_S=block_s,
        BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=fit_block_k(cfg, kd // split_k),
        DEQ_ASM=not interp, DOT_DTYPE=tl.float32 if interp else tl.bfloat16,
        WS=ws, CNT=cnt, SPLIT_K=split_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def run_repacked(
    hidden_states: torch.Tensor,
    experts: RepackedExperts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float | None = None,
    clamp_limit: float | None = None,
    *,
    plan: Plan | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE forward on repacked experts with an optional explicit plan (bench sweeps, tests).

    Same semantics as `op.mxfp4_moe_forward`; `out` ([M, hidden], input dtype) may be given so
    tests can poison it.
    """
    M, K = hidden_states.shape
    E, I = experts.experts, experts.inter  # noqa: E741
    if K != experts.hidden:
        raise ValueError(f"hidden_states has {K} columns, the experts' hidden size is {experts.hidden}")
    topk = topk_ids.shape[1]
    if plan is None:
        plan = make_plan(M, topk, E, K, I)
    if isinstance(plan, _v1.Plan):
        return _v1.run(hidden_states, experts.w13, experts.w2, experts.s13, experts.s2, topk_ids, topk_weights,
                       I, routed_scaling_factor, clamp_limit, plan=plan, out=out, fast_scales=True, nibbles=1)
    dev = hidden_states.device
    if out is None:
        out = torch.empty((M, K), dtype=hidden_states.dtype, device=dev)
    S = M * topk
    if S == 0:
        return out
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    ids = topk_ids.reshape(-1)
    ids = (ids if ids.dtype == torch.int32 else ids.to(torch.int32)).contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    clamp = float(clamp_limit) if clamp_limit is not None and clamp_limit > 0 else None
    scaling = float(routed_scaling_factor) if routed_scaling_factor is not None else 1.0
    g1, g2 = plan.gemm1, plan.gemm2
    sk = g1.split_k
    h = torch.empty((S, I), dtype=_v1._work_dtype(), device=dev)
    down = torch.empty((S, K), dtype=_v1._work_dtype(), device=dev)
    if plan.inline:
        nb1 = nb2 = S
        block_s = triton.next_power_of_2(S)
        sorted1 = blk_e1 = blk_r1 = sorted2 = blk_e2 = blk_r2 = ids
    else:
        block_s = 1
        sorted1, blk_e1, blk_r1, nb1 = _v1._sort_slots(ids, S, E, g1.block_t)
        if g2.block_t == g1.block_t:
            sorted2, blk_e2, blk_r2, nb2 = sorted1, blk_e1, blk_r1, nb1
        else:
            sorted2, blk_e2, blk_r2, nb2 = _v1._sort_slots(ids, S, E, g2.block_t)
    grid1 = (nb1, triton.cdiv(2 * I, g1.block_n), sk)
    ws = cnt = None
    if sk > 1:
        if plan.inline and M > g1.block_t:  # a program must own a single row chunk (see the kernel)
            raise ValueError(f"split-K GEMM1 with inline grouping needs tokens <= block_t ({M} > {g1.block_t})")
        if K % (32 * sk):
            raise ValueError(f"split-K {sk} needs the hidden size {K} to split into whole 32-weight groups")
        ws = torch.empty((sk, S, 2 * I), dtype=torch.float32, device=dev)
        cnt = arrival_counters(dev, grid1[0] * grid1[1])
    w13, w2 = experts.w13.view(torch.int32), experts.w2.view(torch.int32)  # the kernel reads PAIR_SPLIT words
    _launch(g1, grid1, x, w13, experts.s13, h, ids, tw, sorted1, blk_e1, blk_r1, S, I, K, topk, clamp,
            1.0, True, plan.inline, block_s, ws=ws, cnt=cnt, split_k=sk)
    _launch(g2, (nb2, triton.cdiv(K, g2.block_n)), h, w2, experts.s2, down, ids, tw,
            sorted2, blk_e2, blk_r2, S, K, I, 1, None, scaling, False, plan.inline, block_s)
    _k.combine_kernel[(M, triton.cdiv(K, _v1.COMBINE_BLOCK))](
        down, ids, out, out.stride(0), K, TOPK=topk, BLOCK=_v1.COMBINE_BLOCK, num_warps=_v1.COMBINE_NUM_WARPS,
    )
    return out


def moe_forward_repacked(
    hidden_states: torch.Tensor,
    experts: RepackedExperts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float | None = None,
    clamp_limit: float | None = None,
) -> torch.Tensor:
    """Routed-expert MLP of one repacked layer: a new `[M, hidden]` tensor in the input dtype.

    `topk_ids [M, topk]` (-1 = skip the slot), `topk_weights [M, topk]`; `clamp_limit > 0` clamps
    gate (above) and up (both ways) before `silu(gate) * up`; `routed_scaling_factor` multiplies
    the output when not None. CUDA-graph capturable.
    """
    return run_repacked(hidden_states, experts, topk_ids, topk_weights, routed_scaling_factor, clamp_limit)
