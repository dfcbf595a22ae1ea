"""Host side of the block-scaled FP8 GEMM: config table, the shape-keyed planner, the two drop-ins.

Two public entries, each exactly the contract of the sglang 0.5.13.post1 function it replaces:

* `w8a8_block_fp8_linear(input, weight, block_size, weight_scale, input_scale=None, bias=None)`:
  `layers/quantization/fp8_utils.py::triton_w8a8_block_fp8_linear`, the function the sm_120
  dispatch (`dispatch_w8a8_block_fp8_linear`, Triton backend forced on sm_120) hands every
  128x128-block FP8 linear. Upstream quantizes the activation per token and 128-column group (one
  kernel) and then runs `w8a8_block_fp8_matmul_triton` (a second). Here, by rows (`plan`): 1 row
  (1-4 for some shapes) one GEMV launch that quantizes as it goes; up to 16 rows one swap-AB
  tensor-core launch with the quant fused (plus a reduce launch when K is split wide); more rows the
  separate quant and 64-row tensor-core tiles (re-quantizing every group in each output-column
  program would cost more than the launch). Then `output += bias` and the same dtype/shape as upstream.
* `w8a8_block_fp8_matmul(A, B, As, Bs, block_size, output_dtype=torch.float16)`:
  `layers/quantization/fp8_kernel.py::w8a8_block_fp8_matmul_triton`, the GEMM on an already
  quantized activation (As may be column-major, as upstream allows; K need not be a multiple of 128).

What is computed exactly: [128, 128] blocks, e4m3 operands, fp32 scales, bf16/fp16/fp32 output
(and for the linear a bf16/fp16/fp32 contiguous input whose K is a multiple of 128). Any other
variant upstream accepts (UE8M0 int32 scales, other block sizes or fp8 dtypes, a pre-quantized
`input_scale`, empty inputs, ...) goes to upstream's own function, unchanged; where upstream is not
loaded (no SGLang in the process) that raises NotImplementedError instead of answering differently.

Why a planner and not autotuning: grids, splits and buffers are functions of shapes only, so a
CUDA graph captured once replays correctly, and every config the planner can launch is known
ahead of time so `check_sm120` can prove it fits sm_120 (<= 101376 B shared memory, no spills).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple, cast

import torch

from v4flash_kernels.fp8_gemm import kernel as _k
from v4flash_kernels.hook.patches import FP8_GEMM
from v4flash_kernels.kit.device import Counters, num_sms
from v4flash_kernels.kit.e4m3 import GROUP as E4M3_GROUP

FP8 = torch.float8_e4m3fn
GROUP = int(E4M3_GROUP)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_UTILS, UPSTREAM_LINEAR = FP8_GEMM.target_module, FP8_GEMM.target_attr  # what the hook replaces with ours
FP8_KERNEL = "sglang.srt.layers.quantization.fp8_kernel"
UPSTREAM_MATMUL = "w8a8_block_fp8_matmul_triton"
DECODE_MAX_M = 16  # rows the swap-AB decode tile holds (its activation side is padded to 16)
SPLIT_MAX_M = 256  # prefill (more rows) runs upstream's tiling unsplit: never slower than its GEMM
GEMV_MAX_ROWS = 4  # the GEMV's row block (a power of 2 >= M) is at most this
# A split tile whose partials (split x BLOCK_M x BLOCK_N fp32 values) are at most this many is summed
# by its last-arriving program (ticket: one launch); a larger one by a second launch (reduce_kernel),
# which spreads the sum over the GPU. Of the 14 ticket/reduce pairs the H200 sweep timed on one tile
# (16x128 at M = 1 and 4, 64x128 at M = 64), this bound picks the faster in 13 (e.g. 16x128: 8 splits
# ticket 8.50 us vs reduce 8.81 (wo_b, M=4), 32 splits 9.00 vs 7.81 (shared gate_up, M=4); 64x128:
# 16 splits 31.44 vs 11.89 (wqkv_a), 4 splits 18.62 vs 14.30 (wq_b)) and the 14th is a tie (wqkv_a,
# M=4, 16 splits of 16x128: ticket 8.66, reduce 8.68). On 64x64 tiles only the ticket was timed.
TICKET_MAX_ELEMS = 16384
# The GEMV for an (N, K) the table below does not list: a 16 KB weight tile per program (BLOCK_N =
# 16384 / K), 4 warps, for K a power of 2 in the measured range. On the five measured shapes this
# rule is the best non-PDL GEMV (wqkv_a, wq_b, wo_b) or within 5 % of it (gate_up 4.86 vs 4.75 us,
# down 3.53 vs 3.37 us).
GEMV_TILE_BYTES = 16384
GEMV_GENERIC_K = (512, 1024, 2048, 4096)
REDUCE_BLOCK = 256  # outputs per program of reduce_kernel
REDUCE_NUM_WARPS = 4
QUANT_BLOCK_R = 32  # rows per program of the standalone activation quant
QUANT_NUM_WARPS = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(x: int) -> int:
    """The smallest power of 2 >= x (>= 1)."""
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class GemvConfig:
    """`gemv_kernel`: `block_n` weight rows x the whole K per program, the activation quant fused (linear only)."""

    block_n: int
    num_warps: int

    @property
    def name(self) -> str:
        return f"gemv_n{self.block_n}_K_w{self.num_warps}"


@dataclass(frozen=True)
class GemmConfig:
    """One tile of `gemm_kernel` and how far the planner may split K for it."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    swap: bool = False  # tile = W_tile . A_tile^T: the weight fills the MMA's M side (decode rows are few)
    fuse_quant: bool = False  # the linear quantizes the activation inside the GEMM (else act_quant_kernel first)
    max_split: int = 64  # K split over up to this many programs per tile (1: never split)
    ctas_per_sm: int = 2  # programs per SM the split aims at (all resident: one wave)
    group_m: int = 8

    @property
    def tile_name(self) -> str:
        """What a `gemm_kernel` binary depends on (the sweep's naming: `dot_...`)."""
        return (f"dot_m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"
                + ("_swap" if self.swap else "") + ("_fq" if self.fuse_quant else "_sepq")
                + (f"_g{self.group_m}" if self.group_m != 8 else ""))

    @property
    def name(self) -> str:
        return self.tile_name + ("_whole" if self.max_split == 1 else f"_c{self.ctas_per_sm}")


def fixup_for(cfg: GemmConfig, split: int) -> str:
    """How a tile's K split is summed: "whole" (no split), "ticket" (last program) or "reduce" (second launch)."""
    if split <= 1:
        return "whole"
    return "ticket" if split * cfg.block_m * cfg.block_n <= TICKET_MAX_ELEMS else "reduce"


@dataclass(frozen=True)
class Plan:
    """One call's launch: the config and how many programs share each tile's K (1 = no split)."""

    config: GemvConfig | GemmConfig
    split: int = 1

    @property
    def fixup(self) -> str:
        return fixup_for(self.config, self.split) if isinstance(self.config, GemmConfig) else "whole"

    @property
    def name(self) -> str:
        if isinstance(self.config, GemvConfig):
            return self.config.name
        c = self.config  # the sweep's naming: tile, fix-up, programs per SM aimed at, then the split
        return f"{c.tile_name}_{self.fixup}" + (f"c{c.ctas_per_sm}/split{self.split}" if self.split > 1 else "")


# ----------------------------------------------------------------------------- the plan
#
# Chosen from the H200 sweep (`python -m v4flash_bench.fp8_sweep`: CUDA graph of calls on weights rotated
# past L2, the step bench's method; µs per call, "upstream" = sglang's Triton quant + default-config GEMM,
# "before" = this module's previous plan, same run). Every tile below is what the sweep timed, under
# the sweep's name; the fix-up is `fixup_for`'s. PDL variants of the GEMV timed faster still
# (3.2-4.3 us at M = 1), but only because consecutive calls of one kernel overlap in the bench's
# graph; in the model the previous kernel never triggers the early launch, so they do not ship.

# 2..16 rows (1 row where the GEMV does not apply): swap-AB, activation rows padded to 16, 128 weight
# rows per program, K split to ~2 programs per SM, the quant fused. M = 4 (us; wqkv_a / wq_b / wo_b /
# shared gate_up / shared down): 8.68 (reduce; ticket 8.66) / 8.43 (ticket) / 8.50 (ticket) / 7.81
# (reduce) / 5.55 (ticket); before 9.31 / 8.71 / 9.15 / 11.37 / 5.96, upstream 22.38 / 9.58 / 13.70 /
# 22.23 / 6.80. M = 5..16 runs the same tile (its MMA work does not change up to 16 rows; only the
# activation grows). M = 16 was NOT in the sweep (no alternative timed there); this plan itself, in
# the bench run after it shipped: 8.70 / 9.11 / 9.59 / 7.91 / 6.12 at M = 16 (at M = 4: 8.53 / 8.47 / 8.60 /
# GEMV 7.85 / 5.56; upstream at M = 16: 22.20 / 9.44 / 13.64 / 22.12 / 6.73).
DECODE = GemmConfig(16, 128, 4, 2, swap=True, fuse_quant=True)
# 17..256 rows: upstream's tile (64x128, 4 warps, 3 stages, tile groups of 32 rows) after the separate
# quant, K split when the tiles alone leave SMs idle. M = 64: wqkv_a 11.89, shared gate_up 11.80
# (both reduce; before 17.44 / 15.69, upstream 23.42 / 23.31). M = 17..32 takes the 64-row tiles (a
# 16-row tile would stream the weight once per 16 rows); their work at 17-63 rows is that of 64.
# M = 32 was NOT in the sweep; this plan there (bench after shipping): wqkv_a 10.74, wq_b 9.83, wo_b
# 10.42, shared gate_up 10.55, shared down 7.11 (upstream 22.49 / 9.57 / 13.72 / 22.36 / 6.86).
MID = GemmConfig(64, 128, 4, 3, group_m=32)
# ... 64x64 tiles: wo_b 11.99 at M = 64 (ticket, 4 splits; before 18.80, upstream 14.25).
MID_N64 = GemmConfig(64, 64, 4, 3)
# ... unsplit: K is short (<= 8 groups), a split's fix-up costs more than it saves. M = 64: wq_b
# 10.07, shared down 7.39 (before 18.08 / 9.43, upstream 9.83 / 7.11). Also every shape's prefill
# (more than SPLIT_MAX_M rows), unchanged from the first plan.
LARGE = GemmConfig(64, 128, 4, 3, max_split=1, group_m=32)
CONFIGS: Tuple[GemmConfig, ...] = (DECODE, MID, MID_N64, LARGE)
# The GEMM entry's K that is not a multiple of 128 (no DeepSeek-V4 linear; the masked last group):
# the 64x128 tiles spill registers with the masked loads (check_sm120), so these two run it at any M.
RAGGED_CONFIGS: Tuple[GemmConfig, ...] = (DECODE, MID_N64)


@dataclass(frozen=True)
class ShapePlan:
    """What the linear of one (N, K) weight runs at each row count up to SPLIT_MAX_M."""

    gemv: GemvConfig | None  # 1..gemv_max_m rows (None: the tensor-core tiles from one row)
    gemv_max_m: int
    decode: GemmConfig  # up to DECODE_MAX_M rows (and the GEMM entry's rows the GEMV would take)
    mid: GemmConfig  # DECODE_MAX_M + 1 .. SPLIT_MAX_M rows


# DeepSeek-V4-Flash's block-FP8 linears at TP4 (N, K), keyed by shape (the indexer's wq_b is wq_b's).
# GEMV at M = 1 (us; best non-PDL, before, upstream): wqkv_a 5.43 / 9.80 / 22.41, wq_b 5.49 / 9.13 /
# 13.79, wo_b 5.62 / 9.23 / 16.76, shared gate_up 4.75 / 12.65 / 22.26, shared down 3.37 / 6.02 /
# 7.25 (a weight-only read on the same grid: 4.3-4.8 us; an empty launch 1.1 us). At M = 4 the best
# non-PDL GEMV lost to DECODE (wqkv_a 11.52, wq_b 11.83, wo_b 11.45, shared down 6.00 us vs 8.68 /
# 8.43 / 8.50 / 5.55) except on shared gate_up (7.71 vs 7.81), so the GEMV runs 1 row, and 1-4 rows
# for gate_up. The sweep did not time M = 2 or 3: they take the M = 4 choice (the DECODE tile costs
# the same at 1-4 rows, the GEMV grows with them). After shipping, at M = 2: gate_up's GEMV 6.11 us,
# DECODE 8.53 / 8.58 / 8.62 / 5.53 on the others; the GEMV at 2-3 rows on those four is NOT MEASURED.
MEASURED: Dict[Tuple[int, int], ShapePlan] = {
    (1536, 4096): ShapePlan(GemvConfig(4, 4), 1, DECODE, MID),  # wqkv_a
    (8192, 1024): ShapePlan(GemvConfig(16, 4), 1, DECODE, LARGE),  # wq_b, indexer wq_b
    (4096, 2048): ShapePlan(GemvConfig(8, 4), 1, DECODE, MID_N64),  # wo_b
    (1024, 4096): ShapePlan(GemvConfig(8, 8), 4, DECODE, MID),  # shared expert gate_up (2 x 512 per rank)
    (4096, 512): ShapePlan(GemvConfig(16, 4), 1, DECODE, LARGE),  # shared expert down
}


def shape_plan(n: int, k: int) -> ShapePlan:
    """The table's entry for (N, K), else the rule fitted to it (not measured on other shapes): the
    16 KB GEMV at one row where K allows, DECODE to 16 rows, then 64x128 tiles, split unless K is short."""
    hit = MEASURED.get((n, k))
    if hit is not None:
        return hit
    gemv = generic_gemv(k)
    return ShapePlan(gemv, 1 if gemv else 0, DECODE, LARGE if k <= 8 * GROUP else MID)


def generic_gemv(k: int) -> GemvConfig | None:
    """The GEMV of an unlisted shape: GEMV_TILE_BYTES of weight per program, 4 warps (GEMV_GENERIC_K only)."""
    return GemvConfig(GEMV_TILE_BYTES // k, 4) if k in GEMV_GENERIC_K else None


def split_for(cfg: GemmConfig, m: int, n: int, k: int, num_sms: int) -> int:
    """Programs per tile along K: fill ~`ctas_per_sm` x SMs when the tiles alone do not; every split
    gets the same whole number of 128-wide groups except the last (never an empty one)."""
    if m > SPLIT_MAX_M:
        return 1
    groups = cdiv(k, GROUP)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    want = min(cfg.max_split, groups, (cfg.ctas_per_sm * num_sms) // max(1, tiles))
    if want < 2:
        return 1
    return cdiv(groups, cdiv(groups, want))


def plan(m: int, n: int, k: int, num_sms: int, config: GemvConfig | GemmConfig | None = None, *,
         quantized: bool = False) -> Plan:
    """The launch for an [m, k] x [n, k]^T call on a GPU with `num_sms` SMs (pure function of shapes).

    `quantized`: the activation arrives quantized (the GEMM entry), so the GEMV (which quantizes
    itself) is not a candidate and its rows take the decode tile."""
    if config is None and k % GROUP:
        config = DECODE if m <= DECODE_MAX_M else MID_N64  # see RAGGED_CONFIGS
    if config is None:
        sp = shape_plan(n, k)
        if sp.gemv is not None and m <= sp.gemv_max_m and not quantized:
            return Plan(sp.gemv)
        config = sp.decode if m <= DECODE_MAX_M else sp.mid if m <= SPLIT_MAX_M else LARGE
    if isinstance(config, GemvConfig):
        return Plan(config)
    return Plan(config, split_for(config, m, n, k, num_sms))


# ----------------------------------------------------------------------------- what check_sm120 compiles


@dataclass(frozen=True)
class Binary:
    """One `gemm_kernel` specialization the entries can launch."""

    config: GemmConfig
    a_dtype: str  # "bf16" / "fp32": unquantized activation (QUANT_A), "fp8": pre-quantized
    c_dtype: str
    fixup: str  # "whole" / "ticket" / "reduce"
    sp: int = 1  # ticket: the unrolled partial loads (a power of 2 >= the split)
    even_k: bool = True  # False: the GEMM entry's K not a multiple of 128 (masked last group)

    @property
    def name(self) -> str:
        fix = f"ticket{self.sp}" if self.fixup == "ticket" else self.fixup
        return f"{self.config.tile_name}/{self.a_dtype}-{self.c_dtype}/{fix}" + ("" if self.even_k else "/ragged")


@dataclass(frozen=True)
class GemvBinary:
    """One `gemv_kernel` specialization: config, K, row block, activation and output types."""

    config: GemvConfig
    k: int
    bm: int
    x_dtype: str
    c_dtype: str

    @property
    def name(self) -> str:
        return f"{self.config.name}/k{self.k}_bm{self.bm}/{self.x_dtype}-{self.c_dtype}"


def _fixups(cfg: GemmConfig) -> List[Tuple[str, int]]:
    """(fix-up, SP) pairs `fixup_for` can give this config over every split the planner can choose."""
    out = [("whole", 1)]
    for s in range(2, cfg.max_split + 1):
        f = fixup_for(cfg, s)
        pair = (f, pow2(s) if f == "ticket" else 1)
        if pair not in out:
            out.append(pair)
    return out


def launchable() -> Tuple[Binary, ...]:
    """The `gemm_kernel` binaries check_sm120 compiles: per config and fix-up, what DeepSeek-V4
    launches (bf16 in and out; fused quant where the config fuses, else e4m3 A after the quant
    kernel), the widest operands any caller can pass (fp32 in / fp32 out: the most registers and
    shared memory), and the GEMM entry's pre-quantized A (K not a multiple of 128: RAGGED_CONFIGS)."""
    out: Dict[str, Binary] = {}
    for c in CONFIGS:
        # pre-quantized A: after the quant kernel (bf16 out, DeepSeek-V4) unless the config fuses it (then
        # only the GEMM entry, whose widest output stands for the others)
        kinds = [("fp8", "fp32", True)] + ([("fp8", "fp32", False)] if c in RAGGED_CONFIGS else [])
        kinds = [("bf16", "bf16", True), ("fp32", "fp32", True)] + kinds if c.fuse_quant else [
            ("fp8", "bf16", True)] + kinds
        for fix, sp in _fixups(c):
            for a, o, even in kinds:
                b = Binary(c, a, o, fix, sp, even)
                out.setdefault(b.name, b)
    return tuple(out.values())


def launchable_gemv() -> Tuple[GemvBinary, ...]:
    """Every `gemv_kernel` binary a plan can launch: the table's, and the generic rule's per K; row
    blocks up to each entry's rows; bf16 (DeepSeek-V4) and fp32 (the widest) in and out."""
    entries = [(sp.gemv, k, sp.gemv_max_m) for (_, k), sp in MEASURED.items()]
    entries += [(generic_gemv(k), k, 1) for k in GEMV_GENERIC_K]
    out: Dict[str, GemvBinary] = {}
    for cfg, k, max_m in entries:
        if cfg is None:
            continue
        for bm in sorted({pow2(m) for m in range(1, max_m + 1)}):
            for x, o in (("bf16", "bf16"), ("fp32", "fp32")):
                b = GemvBinary(cfg, k, bm, x, o)
                out.setdefault(b.name, b)
    return tuple(out.values())


def launchable_reduce() -> Tuple[int, ...]:
    """The `reduce_kernel` SP values (powers of 2 >= the split) a reduce fix-up can need."""
    sps = set()
    for c in CONFIGS:
        sps |= {pow2(s) for s in range(2, c.max_split + 1) if fixup_for(c, s) == "reduce"}
    return tuple(sorted(sps))



# Split-K tickets, one int32 per output tile (the reducing program resets its tile's); a pool of their own.
_TICKETS = Counters()


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` zeroed split-K tickets for the current stream (two streams never share one)."""
    return _TICKETS.get(device, n)


# ----------------------------------------------------------------------------- launches

FIXUP_CODE = {"whole": int(_k.FIXUP_WHOLE), "ticket": int(_k.FIXUP_TICKET), "reduce": int(_k.FIXUP_PARTIALS)}


def quantize_activation(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token 128-group e4m3 quant of a contiguous [M, K] (K % 128 == 0) -> (codes, [M, K/128] fp32 scales)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, k // GROUP), dtype=torch.float32, device=x.device)
    if m:
        _k.act_quant_kernel[(cdiv(m, QUANT_BLOCK_R), k // GROUP)](
            x, x.stride(0), q, q.stride(0), s, s.stride(0), m, BLOCK_R=QUANT_BLOCK_R, num_warps=QUANT_NUM_WARPS)
    return q, s


def gemv_ok(cfg: GemvConfig, m: int, k: int) -> bool:
    """What `gemv_kernel` computes: 1..4 rows, K a power of 2 and a multiple of 128, BLOCK_N dividing 128."""
    return 1 <= m <= GEMV_MAX_ROWS and k >= GROUP and k & (k - 1) == 0 and GROUP % cfg.block_n == 0


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor,
                cfg: GemvConfig) -> torch.Tensor:
    """`out[M, N] = quant(x) . dequant(weight)^T` through `gemv_kernel` (x [M, K] unquantized, K contiguous)."""
    m, k = x.shape
    n = weight.shape[0]
    assert gemv_ok(cfg, m, k), (cfg, m, k)
    _k.gemv_kernel[(cdiv(n, cfg.block_n),)](
        x, x.stride(0), weight, weight.stride(0), weight_scale, weight_scale.stride(0), weight_scale.stride(1),
        out, out.stride(0), m, n, BM=pow2(m), BLOCK_N=cfg.block_n, K=k, num_warps=cfg.num_warps, num_stages=1)
    return out


def launch(a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
           out: torch.Tensor, p: Plan, a_scale_strides: Tuple[int, int] | None = None) -> torch.Tensor:
    """`out[M, N] = GEMM(a, weight)` through `gemm_kernel`; `a_scale` None: `a` is unquantized and
    quantized in the kernel.

    `a` is [M, K] with K contiguous, `out` [M, N] with N contiguous; `a_scale_strides` overrides the
    strides of `a_scale` (upstream indexes an N-d As by its last two strides).
    """
    m, k = a.shape
    n = weight.shape[0]
    cfg = p.config
    assert isinstance(cfg, GemmConfig)
    groups = cdiv(k, GROUP)
    per = cdiv(groups, p.split)
    split = cdiv(groups, per)
    fixup = fixup_for(cfg, split)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split > 1:
        ws: torch.Tensor = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        cnt = tickets(a.device, tiles) if fixup == "ticket" else ws  # not read (reduce)
    else:
        ws, cnt = out, out  # not read (whole)
    quant_a = a_scale is None
    if quant_a:
        scale, (sam, sak) = weight_scale, (0, 0)  # not read (QUANT_A=True)
    else:
        assert a_scale is not None
        scale = a_scale
        sam, sak = a_scale_strides or (a_scale.stride(0), a_scale.stride(1))
    _k.gemm_kernel[(tiles, split)](
        a, a.stride(0),
        scale, sam, sak,
        weight, weight.stride(0),
        weight_scale, weight_scale.stride(0), weight_scale.stride(1),
        out, out.stride(0),
        ws, m * n, cnt,
        m, n, k, per,
        QUANT_A=quant_a,
        SWAP=cfg.swap,
        FIXUP=FIXUP_CODE[fixup],
        SP=pow2(split) if fixup == "ticket" else 1,
        EVEN_K=k % GROUP == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if fixup == "reduce":
        _k.reduce_kernel[(cdiv(m * n, REDUCE_BLOCK),)](
            ws, out, out.stride(0), m * n, n, split, SP=pow2(split), BLOCK=REDUCE_BLOCK, num_warps=REDUCE_NUM_WARPS)
    return out


def linear_2d(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
              config: GemvConfig | GemmConfig | None = None, split: int | None = None) -> torch.Tensor:
    """The linear's core on a supported call (see `unsupported_linear`): `[M, N]` in x's dtype.

    `config` / `split` override the planner (tests and the benchmark)."""
    m, k = x.shape
    n = weight.shape[0]
    p = plan(m, n, k, num_sms(x.device), config)
    if split is not None:
        p = Plan(p.config, split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if isinstance(p.config, GemvConfig):
        return launch_gemv(x, weight, weight_scale, out, p.config)
    if p.config.fuse_quant:
        return launch(x, None, weight, weight_scale, out, p)
    q, s = quantize_activation(x)
    return launch(q, s, weight, weight_scale, out, p)


# ----------------------------------------------------------------------------- what is computed here


def _is_block(block_size: Any) -> bool:
    try:
        return len(block_size) == 2 and int(block_size[0]) == GROUP and int(block_size[1]) == GROUP
    except TypeError:
        return False


def _weight_issue(weight: torch.Tensor, weight_scale: torch.Tensor) -> str | None:
    if weight.dtype != FP8 or weight.dim() != 2 or not weight.is_contiguous():
        return f"weight {weight.dtype} {tuple(weight.shape)} (contiguous 2-d e4m3fn handled)"
    n, k = weight.shape
    if n == 0 or k == 0:
        return "empty weight"
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (cdiv(n, GROUP), cdiv(k, GROUP)):
        return f"weight_scale {weight_scale.dtype} {tuple(weight_scale.shape)} (fp32 per 128x128 block handled)"
    if weight_scale.device != weight.device:
        return "weight_scale on another device"
    return None


def unsupported_linear(input: torch.Tensor, weight: torch.Tensor, block_size: Sequence[int],
                       weight_scale: torch.Tensor, input_scale: torch.Tensor | None) -> str | None:
    """None when `w8a8_block_fp8_linear` computes this call itself, else why upstream's function does."""
    if input_scale is not None:
        return "pre-quantized input (input_scale)"
    if not _is_block(block_size):
        return f"block_size {block_size!r}"
    why = _weight_issue(weight, weight_scale)
    if why:
        return why
    if input.dtype not in OUT_DTYPES or input.dim() < 1 or input.device != weight.device:
        return f"input {input.dtype} on {input.device}"
    k = input.shape[-1]
    if k != weight.shape[1] or k % GROUP or not input.is_contiguous() or input.numel() == 0:
        return f"input shape {tuple(input.shape)} (contiguous, K = weight's, a multiple of 128, non-empty)"
    return None


def unsupported_matmul(A: torch.Tensor, B: torch.Tensor, As: torch.Tensor, Bs: torch.Tensor,
                       block_size: Sequence[int], output_dtype: torch.dtype) -> str | None:
    """None when `w8a8_block_fp8_matmul` computes this call itself, else why upstream's function does."""
    if not _is_block(block_size):
        return f"block_size {block_size!r}"
    why = _weight_issue(B, Bs)
    if why:
        return why
    if output_dtype not in OUT_DTYPES:
        return f"output_dtype {output_dtype}"
    if A.dtype != FP8 or A.dim() < 2 or not A.is_contiguous() or A.numel() == 0 or A.device != B.device:
        return f"A {A.dtype} {tuple(A.shape)} (contiguous, >= 2-d, e4m3fn, non-empty)"
    k = A.shape[-1]
    if k != B.shape[1]:
        return "A and B disagree on K"
    if As.dtype != torch.float32 or tuple(As.shape) != (*A.shape[:-1], cdiv(k, GROUP)) or As.device != A.device:
        return f"As {As.dtype} {tuple(As.shape)} (fp32, A's rows x ceil(K/128))"
    return None


def upstream_function(module: str, attr: str) -> Callable[..., Any]:
    """SGLang's own function (the one the hook replaced, kept next to ours), for calls we do not compute."""
    from v4flash_kernels.hook.hook import upstream_keep_attr

    mod = sys.modules.get(module)
    fn = None
    if mod is not None:
        kept = upstream_keep_attr(FP8_GEMM) if (module, attr) == (FP8_UTILS, UPSTREAM_LINEAR) else None
        fn = (getattr(mod, kept, None) if kept else None) or getattr(mod, attr, None)
    if fn is None or getattr(fn, "__module__", None) == __name__:
        raise NotImplementedError(f"{module}.{attr} is not loaded in this process")
    return cast(Callable[..., Any], fn)


def _fallback(module: str, attr: str, why: str) -> Callable[..., Any]:
    try:
        return upstream_function(module, attr)
    except NotImplementedError as exc:
        raise NotImplementedError(f"v4flash fp8_gemm does not compute this call ({why}) and {exc}") from None


# ----------------------------------------------------------------------------- the drop-ins


def w8a8_block_fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    block_size: List[int],
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-FP8 linear `input @ dequant(weight)^T (+ bias)`; same contract as sglang 0.5.13.post1
    `fp8_utils.triton_w8a8_block_fp8_linear` (output in the input's dtype and leading shape)."""
    why = unsupported_linear(input, weight, block_size, weight_scale, input_scale)
    if why is not None:
        return cast(torch.Tensor, _fallback(FP8_UTILS, UPSTREAM_LINEAR, why)(input, weight, block_size, weight_scale,
                                                                             input_scale, bias))
    input_2d = input.view(-1, input.shape[-1])
    output_shape = [*input.shape[:-1], weight.shape[0]]
    output = linear_2d(input_2d, weight, weight_scale)
    if bias is not None:
        output += bias
    return output.to(dtype=input_2d.dtype).view(*output_shape)


def w8a8_block_fp8_matmul(
    A: torch.Tensor,
    B: torch.Tensor,
    As: torch.Tensor,
    Bs: torch.Tensor,
    block_size: List[int],
    output_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """`C = A . B^T` with per-token-group `As` and per-block `Bs` scales, a new tensor in `output_dtype`;
    same contract as sglang 0.5.13.post1 `fp8_kernel.w8a8_block_fp8_matmul_triton`."""
    why = unsupported_matmul(A, B, As, Bs, block_size, output_dtype)
    if why is not None:
        return cast(torch.Tensor, _fallback(FP8_KERNEL, UPSTREAM_MATMUL, why)(A, B, As, Bs, block_size, output_dtype))
    k = A.shape[-1]
    n = B.shape[0]
    a2 = A.view(-1, k)
    m = a2.shape[0]
    C = A.new_empty(A.shape[:-1] + (n,), dtype=output_dtype)
    p = plan(m, n, k, num_sms(A.device), quantized=True)
    launch(a2, As, B, Bs, C.view(m, n), p, a_scale_strides=(As.stride(-2), As.stride(-1)))
    return C
