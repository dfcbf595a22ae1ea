"""Host side of the sparse-MLA decode: the config table, the split planner and the public entry.

`sparse_mla_decode` is a drop-in for sglang 0.5.13.post1's
`flash_mla_sm120_triton.flash_mla_sparse_decode_triton`: same positional signature and defaults,
same return convention (`out [B,1,H,512]` bf16, `lse [B,H,1]` fp32 natural-log, `logaddexp(lse,
sink)` when a sink is given, `-inf` lse and zero output for a row with no valid token).

Why a planner and not autotuning: the split count must depend only on shapes (B, H, top-k widths)
so that a CUDA graph captured once replays correctly for any `topk_length` / index contents, and
every launchable config must be known ahead of time so `check_sm120` can prove it fits sm_120.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch
import triton
import triton.language as tl

from v4flash_kernels.attention import kernel as _k
from v4flash_kernels.kit.device import arrival_counters

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant of `split_kernel` (everything that changes the binary)."""

    block_h: int
    block_t: int
    num_warps: int
    num_stages: int = 1
    ksplit: int = 1  # 4: the latent as four 128-wide parts with q re-read per tile (wide head blocks)
    f16: bool = False  # fp16 dot operands instead of bf16 (16-head path; see _dequant_tile)
    shared_bytes: int = 0  # compiled shared memory on sm_120 (and sm_90 unless given below); check_sm120 verifies it
    shared_bytes_sm90: int = 0  # sm_90's value where it differs (Hopper lowers wide-block dots to wgmma)

    @property
    def name(self) -> str:
        return (f"h{self.block_h}_t{self.block_t}_w{self.num_warps}"
                f"{f'_k{self.ksplit}' if self.ksplit > 1 else ''}{'_f16' if self.f16 else ''}")


# The 16-head configs the dispatcher launches. fp16 dot operands: fp8 -> fp16 is one instruction per
# two values where bf16 needs two more per value; on the H200 (2026-11-30, kernels/BENCH.md) that made
# the TP4 call 5-10 % faster at B >= 16 at the same error (fp16 bounds: see _triton_sparse).
T32 = KernelConfig(block_h=16, block_t=32, num_warps=4, f16=True, shared_bytes=81920)
T16 = KernelConfig(block_h=16, block_t=16, num_warps=4, f16=True, shared_bytes=49152)
# 64 heads share each gathered tile; the latent is walked as four 128-wide parts with q re-read
# from L2 per part, so neither q nor a whole-width operand stays in registers (fits sm_120
# with 0 spills; Hopper lowers its dots to wgmma, hence a different shared-memory layout).
WIDE = KernelConfig(block_h=64, block_t=32, num_warps=8, ksplit=4, shared_bytes=81920, shared_bytes_sm90=49152)

# Every split-kernel config the dispatcher may launch. check_sm120 cross-compiles each of them
# (every epilogue it can take) for sm_120 and sm_90 and fails if one exceeds sm_120's shared
# memory or spills. Variants measured and dropped: bf16 operands and 8 warps stay constructible
# here for the A/B scripts; register prefetch and the latent across warps, which needed their own
# kernel paths, live in kernels/scripts/attention_variants.py.
SPLIT_CONFIGS: Tuple[KernelConfig, ...] = (T32, T16, WIDE)
# Dispatcher preference, best first (H200 measurements); the first one that fits two CTAs per SM
# in the device's shared memory is used.
PREFERRED = (T32, T16)
SMEM_PER_CTA_RESERVED = 1024  # the driver reserves 1 KB of shared memory per CTA
COMBINE_SPLIT_BLOCK = 32
COMBINE_NUM_WARPS = 4

# Fewest top-k tiles one split walks, and how many CTAs per SM the planner aims for (8 was
# the best measured on the H200: small B gets 1-tile splits).
MIN_TILES_PER_SPLIT = 1
CTAS_PER_SM = 8
MAX_SPLITS = 256
BIG_BATCH_MIN_TILES = 4


def min_tiles_for(row_blocks: int, width_extra: int) -> int:
    """Fewest tiles per split on a layer with an extra cache, by (batch x head blocks).

    H200, TP4 call (16 heads), 2026-11-30: longer splits once the batch fills a good part of the
    GPU (c128@128K B=16: 2 tiles 23.1 us vs 1 tile 27.5; B=64: 4 tiles 53.4 vs 3 tiles 59.9; c4 B=16
    lost 1.1 us with 2). SWA-only rows have 4 tiles; they keep 1-tile splits (SWA B=64: 18.4 vs 20.4).
    """
    if width_extra <= 0:
        return MIN_TILES_PER_SPLIT
    if row_blocks >= 64:
        return BIG_BATCH_MIN_TILES
    return 2 if row_blocks >= 16 else MIN_TILES_PER_SPLIT


# Large batch x a multiple of 64 heads on a layer with an extra (c4/c128) cache: the wide head block gathers and
# dequantizes each token once for 64 heads instead of 4 times. H200, 2026-11-29 (kernels/BENCH.md):
# 1.1-1.5x faster at B >= 16 on c4/c128; SWA-only layers (<= 128 tokens per row) were 6-11 %
# slower, and B <= 4 is left on the measured 16-head path. The wide block holds a whole SM's
# registers, so it is planned for fewer, longer splits (best measured: 2 CTAs/SM at B >= 32,
# 4 at B = 16, at least 2 tiles per split).
WIDE_MIN_BATCH = 16
WIDE_MIN_TILES = 2


def wide_ctas_per_sm(batch: int) -> int:
    return 2 if batch >= 32 else 4


def use_wide(batch: int, heads: int, width_extra: int, smem_per_sm: int) -> bool:
    """Whether the planner launches `WIDE` for this shape (pure function of shapes and the GPU)."""
    return (batch >= WIDE_MIN_BATCH and heads % WIDE.block_h == 0 and width_extra > 0
            and WIDE.shared_bytes + SMEM_PER_CTA_RESERVED <= smem_per_sm)


@dataclass(frozen=True)
class Plan:
    """How one call is laid out on the GPU; a pure function of shapes and the SM count."""

    config: KernelConfig
    chunk: int  # tokens per split (multiple of block_t)
    splits_main: int
    splits_extra: int
    fused: bool = False  # split programs merge cooperatively (one launch); run() checks the grid is resident

    @property
    def num_splits(self) -> int:
        return self.splits_main + self.splits_extra


def choose_config(batch: int, heads: int, smem_per_sm: int = 233472, width_extra: int = -1) -> KernelConfig:
    """16 heads x 32 tokens, 4 warps where two CTAs fit an SM (H200: 228 KB); else 16-token tiles.

    SWA-only layers (`width_extra == 0`) at small batch also take 16-token tiles: their 128-token
    rows then split 8 ways instead of 4 (H200, TP4, B=1: 12.2 vs 12.7 us).

    On sm_120 (100 KB of shared memory per SM) the 80 KB 32-token config would run one 4-warp CTA
    per SM, so the 48 KB 16-token config (two CTAs per SM) is chosen there: an occupancy argument,
    not an sm_120 measurement. Wider head blocks would share each gathered token with more heads,
    but with Triton's mma.sync layout every warp holds the whole [BLOCK_H, 512] q operand, so
    32/64-head blocks spill on sm_120 (kernels/BENCH.md); 8 warps duplicate the QK MMA. `make_plan`
    swaps in `WIDE` (which avoids that by walking the latent in four parts, see `use_wide`) for
    large batches.
    """
    if width_extra == 0 and batch * math.ceil(heads / T16.block_h) < 16:
        return T16
    for cfg in PREFERRED:
        if 2 * (cfg.shared_bytes + SMEM_PER_CTA_RESERVED) <= smem_per_sm:
            return cfg
    return PREFERRED[-1]


def make_plan(
    batch: int,
    heads: int,
    width_main: int,
    width_extra: int,
    num_sms: int,
    config: KernelConfig | None = None,
    min_tiles: int = MIN_TILES_PER_SPLIT,
    ctas_per_sm: int | None = None,
    smem_per_sm: int = 233472,
    fused: bool | None = None,
) -> Plan:
    """Split the top-k axes of both caches into equal chunks so the grid covers ~ctas_per_sm waves.

    `fused` = the one-launch cooperative merge (run() still falls back to split + combine when the
    grid is larger than the GPU). Default: on for layers with an extra cache whose grid has at most
    one program per SM. H200, TP4 call, one-pass merges (kernels/BENCH.md, 2026-11-30): c4 B=1
    14.0 vs 14.5 us, c4 B=4 14.1 vs 14.8, c128@128K B=1 14.3 vs 16.4, c128@256K B=1 15.6 vs
    19.4; SWA-only layers were 0.4-2.4 us slower with it, so they keep two launches.
    """
    if config is None and use_wide(batch, heads, width_extra, smem_per_sm):
        config = WIDE
        min_tiles = max(min_tiles, WIDE_MIN_TILES)
        if ctas_per_sm is None:
            ctas_per_sm = wide_ctas_per_sm(batch)
    if config is None:
        min_tiles = max(min_tiles, min_tiles_for(batch * math.ceil(heads / 16), width_extra))
    cfg = config or choose_config(batch, heads, smem_per_sm, width_extra)
    if ctas_per_sm is None:
        ctas_per_sm = CTAS_PER_SM
    bt = cfg.block_t
    tiles_main = max(1, math.ceil(width_main / bt))
    tiles_extra = math.ceil(width_extra / bt) if width_extra > 0 else 0
    base_ctas = batch * math.ceil(heads / cfg.block_h)
    target = max(1, num_sms * ctas_per_sm)
    if base_ctas >= num_sms:
        # The batch alone fills the GPU: every extra split now only adds a 32 KB fp32 partial
        # write + read (SWA B=64 H=64: 1 split 34 us vs 4 splits 48 us on the H200).
        min_tiles = max(min_tiles, BIG_BATCH_MIN_TILES)
    per_split = max(min_tiles, math.ceil((tiles_main + tiles_extra) * base_ctas / target))
    while True:
        s_main = math.ceil(tiles_main / per_split)
        s_extra = math.ceil(tiles_extra / per_split) if tiles_extra else 0
        if s_main + s_extra <= MAX_SPLITS:
            break
        per_split *= 2
    ns = s_main + s_extra
    if fused is None:
        fused = width_extra > 0 and cfg.ksplit == 1 and ns > 1 and coop_fits(ns * base_ctas, num_sms)
    return Plan(cfg, per_split * bt, s_main, s_extra, fused=fused)


def coop_fits(programs: int, num_sms: int) -> bool:
    """Whether a grid may use the cooperative merge: every program must be able to be resident at
    once (its programs wait for each other), so at most one per SM, whatever else shares the GPU."""
    return programs <= num_sms


_DEVICE_INFO: Dict[int, Tuple[int, int]] = {}


def _device_info(device: torch.device) -> Tuple[int, int]:
    """(SM count, shared memory per SM in bytes), cached per device; host-only, graph-safe."""
    if device.type != "cuda":
        return 4, 233472
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _DEVICE_INFO:
        props = torch.cuda.get_device_properties(key)
        smem = getattr(props, "shared_memory_per_multiprocessor", None)
        if not smem:
            smem = 102400 if props.major == 12 else 233472
        _DEVICE_INFO[key] = (props.multi_processor_count, int(smem))
    return _DEVICE_INFO[key]


def _num_sms(device: torch.device) -> int:
    return _device_info(device)[0]


def _dot_dtype(cfg: KernelConfig) -> Any:
    # The interpreter computes bf16 on raw bits, so bf16 configs get fp32 operands there; fp16 is
    # real numpy arithmetic and runs as on the GPU.
    if cfg.f16:
        return tl.float16
    return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16


def _cache_views(cache: torch.Tensor) -> Any:
    """Flat uint8 / float8 / bf16 views of a paged cache whose page stride is `stride(0)` bytes."""
    if cache.element_size() != 1:
        raise TypeError(f"fp8_ds_mla cache must be uint8 or float8 (got {cache.dtype})")
    pages, page_size = cache.shape[0], cache.shape[1]
    page_bytes = cache.stride(0)
    if page_bytes % 16 or page_bytes < page_size * _k.TOKEN_BYTES:
        # The kernel issues 16-byte vector loads; SGLang pages are multiples of 576 bytes.
        raise ValueError(f"bad fp8_ds_mla page stride {page_bytes} for page size {page_size}")
    if cache.data_ptr() % 16:
        raise ValueError("fp8_ds_mla cache must start on a 16-byte boundary")
    flat = cache.as_strided((pages * page_bytes,), (1,))
    u8 = flat.view(torch.uint8)
    return u8.view(torch.float8_e4m3fn), u8.view(torch.int64), u8.view(torch.bfloat16), page_size, page_bytes


def _flat_indices(indices: torch.Tensor, batch: int) -> torch.Tensor:
    flat = indices.reshape(batch, -1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    if flat.shape[1] and flat.stride(1) != 1:
        flat = flat.contiguous()
    return flat


def _lengths(length: torch.Tensor | None) -> torch.Tensor | None:
    if length is None:
        return None
    length = length.reshape(-1)
    return length if length.dtype == torch.int32 else length.to(torch.int32)


def run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    plan: Plan | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    head_range: Tuple[int, int] | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The decode with an optional explicit plan (the benchmark sweeps plans through this).

    `out` ([B,1,H,512] bf16) and `lse` ([B,1,H] fp32, last dim contiguous) may be given so tests can
    poison them and prove every element is written. `head_range=(start, stop)` computes only those heads:
    q and the sink are read, and out / lse written, only there (the rest of out / lse is left as
    it was); the plan is made for `stop - start` heads.
    """
    B, s_q, H_all, D = q.shape
    if s_q != 1 or D != _k.HEAD_DIM:
        raise ValueError(f"q must be [B, 1, H, 512], got {tuple(q.shape)}")
    h0, h1 = check_head_range(head_range, H_all)
    H = h1 - h0
    if q.stride(3) != 1:
        q = q.contiguous()
    dev = q.device

    k8_a, ks_a, kbf_a, ps_a, pb_a = _cache_views(k_cache)
    idx_a = _flat_indices(indices, B)
    len_a = _lengths(topk_length)
    if extra_k_cache is not None and extra_indices is not None:
        k8_b, ks_b, kbf_b, ps_b, pb_b = _cache_views(extra_k_cache)
        idx_b = _flat_indices(extra_indices, B)
        len_b = _lengths(extra_topk_length)
        w_b = idx_b.shape[1]
    else:
        k8_b, ks_b, kbf_b, ps_b, pb_b = k8_a, ks_a, kbf_a, ps_a, pb_a
        idx_b, len_b, w_b = idx_a, None, 0
    w_a = idx_a.shape[1]

    if plan is None:
        sms, smem = _device_info(dev)
        plan = make_plan(B, H, w_a, w_b, sms, smem_per_sm=smem)
    cfg = plan.config
    ns = plan.num_splits

    if out is None:
        out = torch.empty((B, 1, H_all, _k.HEAD_DIM), dtype=torch.bfloat16, device=dev)
    if lse is None:
        lse = torch.empty((B, 1, H_all), dtype=torch.float32, device=dev)
    if B == 0 or H == 0:
        return out, lse.permute(0, 2, 1)
    # This rank's heads as views: the kernels only ever address rows [0, H) of them.
    q_v, out_v, lse_v = q[:, :, h0:h1], out[:, :, h0:h1], lse[:, :, h0:h1]
    sink = attn_sink
    if sink is not None:
        sink = sink.reshape(-1)[h0:h1]
        if sink.dtype != torch.float32:
            sink = sink.float()
    hblocks = triton.cdiv(H, cfg.block_h)
    # The cooperative merge needs all programs resident together: checked here too, so a
    # hand-made plan cannot deadlock; the interpreter runs programs one after another, so never there.
    coop = plan.fused and coop_fits(ns * hblocks * B, _num_sms(dev)) and os.environ.get("TRITON_INTERPRET") != "1"
    epilogue = epilogue_for(cfg, ns, coop)
    if epilogue == 2:
        ws_o = ws_l = cnt = lse_v  # unused (typed dummies)
    else:
        ws_o = torch.empty((B, H, ns, _k.HEAD_DIM), dtype=torch.float32, device=dev)
        ws_l = torch.empty((B, H, ns), dtype=torch.float32, device=dev)
        cnt = arrival_counters(dev, 2 * B * hblocks) if epilogue == 1 else ws_l

    grid = (ns, hblocks, B)
    _k.split_kernel[grid](
        q_v, q_v.stride(0), q_v.stride(2),
        k8_a, ks_a, kbf_a, idx_a, len_a if len_a is not None else idx_a,
        w_a, ps_a, pb_a, idx_a.stride(0),
        k8_b, ks_b, kbf_b, idx_b, len_b if len_b is not None else idx_b,
        w_b, ps_b, pb_b, idx_b.stride(0),
        ws_o, ws_l,
        H, plan.splits_main, ns, plan.chunk, float(softmax_scale) * LOG2E,
        out_v, out_v.stride(0), out_v.stride(2), lse_v, lse_v.stride(0),
        sink if sink is not None else lse_v, cnt,
        HAS_LEN_A=len_a is not None,
        HAS_LEN_B=len_b is not None,
        BLOCK_H=cfg.block_h,
        BLOCK_T=cfg.block_t,
        KSPLIT=cfg.ksplit,
        DOT_DTYPE=_dot_dtype(cfg),
        EPILOGUE=epilogue,
        HAS_SINK=sink is not None,
        MERGE_SB=merge_splits_per_load(cfg),
        MERGE_COLS=MERGE_COLS,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if epilogue == 0:
        _k.combine_kernel[(H, B)](
            ws_o, ws_l, out_v, out_v.stride(0), out_v.stride(2), lse_v, lse_v.stride(0),
            sink if sink is not None else ws_l,
            H, ns,
            HAS_SINK=sink is not None,
            SPLIT_BLOCK=COMBINE_SPLIT_BLOCK,
            num_warps=COMBINE_NUM_WARPS,
        )
    return out, lse.permute(0, 2, 1)


def epilogue_for(cfg: KernelConfig, num_splits: int, coop: bool) -> int:
    """How the split kernel ends: 2 = one split finishes the row, 1 = cooperative merge, 0 = partials
    for `combine_kernel` (a second launch).

    The wide block (ksplit 4) takes neither 1 nor 2: with four accumulators live both spill on
    sm_120 (check_sm120); the planner uses it only at B >= 16 with an extra cache (>= 2 splits,
    a grid larger than the GPU).
    """
    if cfg.ksplit != 1:
        return 0
    if num_splits == 1:
        return 2
    return 1 if coop else 0


def launchable_epilogues(cfg: KernelConfig) -> Tuple[int, ...]:
    """The epilogues `run` can launch for `cfg`: what check_sm120 compiles."""
    return (0, 1, 2) if cfg.ksplit == 1 else (0,)


def check_head_range(heads: Tuple[int, int] | None, total: int) -> Tuple[int, int]:
    """Validate `head_range=(start, stop)` against q's head count; None = all heads."""
    if heads is None:
        return 0, total
    h0, h1 = (int(heads[0]), int(heads[1]))
    if not 0 <= h0 <= h1 <= total:
        raise ValueError(f"head_range={tuple(heads)} is not a range inside q's {total} heads")
    return h0, h1


MERGE_COLS = 32  # columns per slice of the cooperative merge (a c4 B=1 row: 16 slices over 20 programs)


def merge_splits_per_load(cfg: KernelConfig) -> int:
    """Splits one merge step loads: [block_h, n, MERGE_COLS] fp32 stays at 64 registers a thread."""
    return max(1, (64 * 32 * cfg.num_warps) // (cfg.block_h * MERGE_COLS))


def sparse_mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    head_dim_v: int,
    softmax_scale: float,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    head_range: Tuple[int, int] | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over the SWA cache plus an optional extra (c4/c128) cache, one softmax.

    Same contract as sglang 0.5.13.post1 `flash_mla_sparse_decode_triton`; `head_dim_v` is
    accepted for compatibility (the latent is always 512 wide: K = V). `head_range=(start, stop)`
    (keyword only) computes just those heads of q: q and `attn_sink` are read, and out / lse
    written, only there; the other heads of the returned tensors are left unwritten (the caller
    slices, as SGLang does at attention-TP > 1; see tp_heads).
    """
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    return run(
        q, k_cache, indices, topk_length, attn_sink, softmax_scale,
        extra_k_cache, extra_indices, extra_topk_length, head_range=head_range,
    )
