"""Host side of the fused compressor: the shape-only plan, the functional op and SGLang's drop-in.

Which upstream code this replaces: sglang 0.5.13.post1 on CUDA runs the DeepSeek-V4 compressors
through `layers/attention/dsv4/compressor_v2.py` (`SGLANG_OPT_USE_COMPRESSOR_V2` defaults on and
nothing turns it off on sm_120): the attention backend's `forward_core_compressor` and
`forward_indexer_compressor` (both the mixin's `forward_unified`) compute `kv_score =
linear_bf16_fp32(x, wkv_gate.weight)` (cuBLAS), then the JIT `compress_forward` (state ring update +
window pooling) and `compress_norm_rope_store` (RMSNorm + RoPE (+ Hadamard) + FP8 quant + paged store):
three launches per compressor, three compressors per c4 layer pair. `Compressor.forward` (the v1 path)
is not called on that path. `forward_unified` is the smallest method that spans all of it, so it is
what the patch replaces (`forward_unified`, the same function under its two class attributes).

The drop-in runs one launch (`kernel.compressor_decode_kernel`) when the call is a plain decode step
on CUDA at <= `MAX_ROWS` rows with the shapes and dtypes DeepSeek-V4-Flash has, and hands everything
else to upstream's own `forward_unified`, unchanged (`decline` says why): idle batches, prefill /
extend / target-verify / draft-extend plans, the online c128 state, HIP, context parallelism, the
FP4 indexer cache, HiSparse's c4 pool, more rows, and any shape or dtype upstream's kernels would
treat differently. What a fused call writes is what upstream's writes: the state ring (every row's
fp32 kv + score at its write slot) and, for the rows whose window completes, the compressed token
in the paged cache; nothing else (upstream's uninitialised rows for the other tokens are not
stored by either).

Where the two differ (only on inputs the planner never makes): a row with `seq_len <= 0` completes
no window here (upstream would read RoPE position `-ratio`); a negative `write_loc` is not written
(upstream writes before the buffer); a c128 row pools exactly when its `seq_len % 128 == 0` (upstream's
compress kernel asks `write_loc % 128 == 127`, its store `seq_len % 128`; the planner makes them
agree, and where they would not, upstream stores an uninitialised row).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Tuple, cast

import torch

from v4flash_kernels.compressor import kernel as _k
from v4flash_kernels.kit.device import arrival_counters

V2_MODULE = "sglang.srt.layers.attention.dsv4.compressor_v2"
MAX_ROWS = 16  # decode rows fused in one launch (the dot's padded T); more go to upstream
ROPE_DIM = 64
MLA_DIM, INDEX_DIM = 512, 128


FMA_ROWS = 4  # up to here the GEMV runs on the CUDA cores from one load of the whole weight tile


@dataclass(frozen=True)
class Plan:
    """One compiled variant of `compressor_decode_kernel` (a pure function of the shape: graph-safe).

    `bd` head dims per program (grid = head_dim / bd, 128-256 programs, each streaming its 2 * coff * bd
    weight rows over the whole K once). `mma`: tensor-core dots over `bk`-wide pipelined steps, the
    rows padded to the dot's 16 (`rows_pad`) by masked loads; else (`block_t` <= 4 rows) one load of
    the whole [rows, K] tile, reduced on the CUDA cores. `epi_t`: rows the finishing program stores
    per pass.
    """

    ratio: int
    head_dim: int
    k: int
    bd: int
    rows_pad: int
    mma: bool = True
    bk: int = 256
    block_t: int = MAX_ROWS
    epi_t: int = 8
    num_warps: int = 4
    num_stages: int = 4

    @property
    def coff(self) -> int:
        return 2 if self.ratio == 4 else 1

    @property
    def programs(self) -> int:
        return self.head_dim // self.bd

    @property
    def indexer(self) -> bool:
        return self.head_dim == INDEX_DIM

    @property
    def name(self) -> str:
        gemv = f"mma_bk{self.bk}_s{self.num_stages}" if self.mma else "fma"
        return (f"c{self.ratio}_d{self.head_dim}_k{self.k}_bd{self.bd}_{gemv}_t{self.block_t}_e{self.epi_t}"
                f"_w{self.num_warps}")


# (ratio, head_dim) -> head dims per program, (CUDA-core plan, tensor-core plan): the attention c4
# (4 sections x 512), c128 (2 x 512) and the indexer's c4 (4 x 128). The CUDA-core plan keeps each
# program's tile at 8 (or 4) rows x 4096 in registers (64 KB / 32 KB in flight per program); the
# tensor-core plan gives each 128 programs.
BD = {(4, MLA_DIM): (2, 4), (128, MLA_DIM): (4, 4), (4, INDEX_DIM): (1, 1)}
KINDS: Tuple[Tuple[int, int], ...] = tuple(BD)


def plan_for(ratio: int, head_dim: int, k: int, rows: int = MAX_ROWS) -> Plan:
    """The launch plan of one compressor kind at hidden size `k` and `rows` decode rows (shapes only).
    KeyError for a kind DeepSeek-V4 does not have."""
    fma_bd, mma_bd = BD[(ratio, head_dim)]
    sections = 2 * (2 if ratio == 4 else 1)
    if rows <= FMA_ROWS:
        return Plan(ratio, head_dim, k, fma_bd, sections * fma_bd, mma=False, bk=k, block_t=FMA_ROWS,
                    epi_t=FMA_ROWS, num_warps=8 if sections * fma_bd >= 8 else 4, num_stages=1)
    return Plan(ratio, head_dim, k, mma_bd, max(16, sections * mma_bd), epi_t=16 if head_dim == INDEX_DIM else 8)


def launchable(k: int = 4096) -> Tuple[Plan, ...]:
    """Every plan the drop-in can launch at DeepSeek-V4-Flash's hidden size (what check_sm120 compiles)."""
    return tuple(plan_for(r, d, k, rows) for r, d in KINDS for rows in (1, MAX_ROWS))


def mla_page_bytes(page_size: int) -> int:
    """FlashMLA cache page: 584 bytes per token (576 + 8 scale bytes), padded to a multiple of 576."""
    return -(-584 * page_size // 576) * 576


def index_page_bytes(page_size: int) -> int:
    return 132 * page_size


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------- the functional op


def compress_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    plan_d: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    freqs: torch.Tensor,
    out_loc: torch.Tensor,
    cache: torch.Tensor,
    page_size: int,
    *,
    ratio: int,
    head_dim: int,
    plan: Plan | None = None,
) -> None:
    """One decode step of one compressor, in place on `state` and `cache` (see `kernel`).

    x `[T, K]` bf16; weight `[2 coff hd, K]` bf16; state `[slots, 2 coff hd]` fp32; plan_d `[T, 4]` int32
    (seq_len, write slot, previous-window page, this page); ape `[ratio coff, hd]` fp32; norm_weight
    `[hd]` fp32; freqs `[positions, 64]` fp32 (cos, sin pairs); out_loc `[T]` int32; cache `[pages,
    page bytes]` uint8. The caller (`forward_unified` or a test) has checked what `shape_problem` checks.
    """
    T = x.shape[0]
    if T == 0:
        return
    p = plan or plan_for(ratio, head_dim, x.shape[1], T)
    wide = cache.view(torch.float32 if head_dim == INDEX_DIM else torch.bfloat16)
    pooled = torch.empty((T, head_dim), dtype=torch.float32, device=x.device)
    cnt = arrival_counters(x.device, 1)
    _k.compressor_decode_kernel[(p.programs,)](
        x, x.stride(0), weight, plan_d, state, ape, norm_weight, float(eps), freqs, freqs.stride(0), out_loc,
        cache, wide, cache.stride(0), page_size.bit_length() - 1, pooled, cnt, T,
        K=x.shape[1], HD=head_dim, RATIO=ratio, INDEXER=head_dim == INDEX_DIM, BD=p.bd, ROWS_PAD=p.rows_pad,
        BK=p.bk, BLOCK_T=p.block_t, EPI_T=p.epi_t, MMA=p.mma, INTERPRET=_interpreting(),
        num_warps=p.num_warps, num_stages=p.num_stages,
    )


def shape_problem(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, plan_d: torch.Tensor,
                  ape: torch.Tensor, norm_weight: torch.Tensor, freqs_cis: torch.Tensor, out_loc: torch.Tensor,
                  cache: torch.Tensor, page_size: int, ratio: int, head_dim: int) -> str | None:
    """Why the fused kernel would not compute exactly what upstream's kernels do on these tensors
    (None: it does). Upstream's own checks then raise or take their own path on the same call."""
    T = x.shape[0] if x.dim() == 2 else -1
    if (ratio, head_dim) not in BD:
        return f"no fused kernel for ratio {ratio} at head_dim {head_dim}"
    coff = 2 if ratio == 4 else 1
    n = 2 * coff * head_dim
    tensors = (x, weight, state, plan_d, ape, norm_weight, freqs_cis, out_loc, cache)
    if not all(t.device == x.device for t in tensors):
        return "tensors on several devices"
    if x.device.type != "cuda" and not _interpreting():
        return f"tensors on {x.device.type}"
    if not 1 <= T <= MAX_ROWS:
        return f"{T} rows (fused: 1..{MAX_ROWS})"
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        return "x is not [T, K] bf16 with contiguous rows"
    k = x.shape[1]
    if k % plan_for(ratio, head_dim, k).bk or k & (k - 1):
        return f"hidden size {k} is not a power of two (a multiple of the K step)"
    if weight.dtype != torch.bfloat16 or tuple(weight.shape) != (n, k) or not weight.is_contiguous():
        return f"wkv_gate weight is not contiguous [{n}, {k}] bf16"
    if (state.dtype != torch.float32 or state.dim() != 2 or state.shape[1] != n or not state.is_contiguous()
            or state.shape[0] % ratio):
        return f"state is not contiguous [slots, {n}] fp32 in whole pages of {ratio}"
    if plan_d.dtype != torch.uint8 or tuple(plan_d.shape) != (T, 16) or not plan_d.is_contiguous():
        return "decode plan is not [T, 16] uint8"
    if ape.dtype != torch.float32 or ape.numel() != ratio * coff * head_dim or not ape.is_contiguous():
        return "ape is not contiguous fp32 of ratio x coff x head_dim"
    if norm_weight.dtype != torch.float32 or tuple(norm_weight.shape) != (head_dim,):
        return "norm weight is not [head_dim] fp32"
    if (freqs_cis.dtype != torch.complex64 or freqs_cis.dim() != 2 or freqs_cis.shape[1] != ROPE_DIM // 2
            or not freqs_cis.is_contiguous()):
        return "freqs_cis is not contiguous [positions, 32] complex64"
    if out_loc.dtype != torch.int32 or tuple(out_loc.shape) != (T,):
        return "out_loc is not [T] int32"
    if page_size <= 0 or page_size & (page_size - 1):
        return f"page size {page_size} is not a power of two"
    page_bytes = index_page_bytes(page_size) if head_dim == INDEX_DIM else mla_page_bytes(page_size)
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != page_bytes or cache.stride(1) != 1 \
            or cache.stride(0) != page_bytes:
        return f"cache is not [pages, {page_bytes}] uint8"
    return None


# ----------------------------------------------------------------------------- the SGLang drop-in


def decline(backend: Any, x: torch.Tensor, forward_batch: Any, compressor: Any) -> str | None:
    """Why this call goes to upstream's `forward_unified` (None: the fused kernel takes it). Reads
    only host-side facts: no device sync, nothing data-dependent."""
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return "idle batch"
    v2 = sys.modules.get(V2_MODULE)
    if v2 is not None and getattr(v2, "_is_hip", False):
        return "HIP"
    ratio, head_dim = int(compressor.ratio), int(compressor.head_dim)
    if v2 is not None and ratio == 128 and v2._use_online_compress(ratio):
        return "online c128 compress (SGLANG_OPT_USE_ONLINE_COMPRESS)"
    if getattr(forward_batch, "attn_cp_metadata", None) is not None:
        return "context parallelism"
    indexer = bool(compressor.is_in_indexer)
    if indexer and getattr(backend, "enable_deepseek_v4_fp4_indexer", False):
        return "FP4 indexer cache"
    if not (bool(compressor.rotate) == indexer == (head_dim == INDEX_DIM)):
        return "rotate / indexer / head_dim disagree"
    plan = backend._get_paged_compress_metadata(ratio)
    if not getattr(plan, "is_decode", False):
        return "not a decode plan (prefill / extend / verify)"
    if int(plan.compress_ratio) != ratio:
        return "plan of another ratio"
    return None


@dataclass(frozen=True)
class Call:
    """Everything one fused call reads, gathered from SGLang's objects the way upstream does."""

    x: torch.Tensor
    weight: torch.Tensor
    state: torch.Tensor
    plan_d: torch.Tensor
    ape: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    freqs_cis: torch.Tensor
    out_loc: torch.Tensor
    cache: torch.Tensor
    page_size: int
    ratio: int
    head_dim: int

    def problem(self) -> str | None:
        return shape_problem(self.x, self.weight, self.state, self.plan_d, self.ape, self.norm_weight,
                             self.freqs_cis, self.out_loc, self.cache, self.page_size, self.ratio, self.head_dim)

    def run(self) -> None:
        freqs = torch.view_as_real(self.freqs_cis).flatten(-2)
        compress_decode(self.x, self.weight, self.state, self.plan_d.view(torch.int32), self.ape, self.norm_weight,
                        self.eps, freqs, self.out_loc, self.cache, self.page_size, ratio=self.ratio,
                        head_dim=self.head_dim)


def gather(backend: Any, x: torch.Tensor, layer_id: int, compressor: Any) -> Call | str:
    """The call's tensors as upstream's `forward_unified` finds them, or why it cannot be fused."""
    ratio, head_dim = int(compressor.ratio), int(compressor.head_dim)
    pool = backend.token_to_kv_pool
    if compressor.is_in_indexer:
        cache = pool.get_index_k_with_scale_buffer(layer_id)
        page_size = pool.get_index_k_page_size()
    else:
        _, _, compress_kv_pool = pool.layer_mapping[layer_id]
        if compress_kv_pool is None:
            return "no compressed KV pool for this layer"
        if hasattr(compress_kv_pool, "translate_loc_to_hisparse_device"):
            return "HiSparse c4 pool"
        cache = pool.get_extra_key_buffer(layer_id)
        page_size = pool.get_extra_key_page_size(layer_id)
    state_pool = compressor.get_state_pool(backend)
    plan = backend._get_paged_compress_metadata(ratio)
    norm = compressor.norm
    return Call(x, compressor.wkv_gate.weight, state_pool.kv_score_buffer.kv_score, plan.plan_d, compressor.ape,
                norm.weight, float(norm.variance_epsilon), compressor.freqs_cis, backend._get_out_loc(ratio),
                cache.view(dtype=torch.uint8), int(page_size), ratio, head_dim)


def upstream_forward_unified() -> Callable[..., Any]:
    """Upstream's `CompressorBackendMixin.forward_unified` (what its two aliases name): the hook's kept
    original where it installed ours, else the mixin's own name for it (never replaced)."""
    from v4flash_kernels.hook.hook import upstream_keep_attr
    from v4flash_kernels.hook.patches import COMPRESSOR_CORE, COMPRESSOR_INDEXER

    mod = sys.modules.get(V2_MODULE)
    for spec in (COMPRESSOR_CORE, COMPRESSOR_INDEXER):
        fn = getattr(mod, upstream_keep_attr(spec), None)
        if fn is not None:
            return cast(Callable[..., Any], fn)
    fn = getattr(getattr(mod, "CompressorBackendMixin", None), "forward_unified", None)
    if fn is None or fn is forward_unified:
        raise RuntimeError(f"{V2_MODULE}.CompressorBackendMixin.forward_unified: upstream's compressor is not loaded")
    return cast(Callable[..., Any], fn)


def forward_unified(self: Any, x: torch.Tensor, forward_batch: Any, layer_id: int, compressor: Any) -> None:
    """`CompressorBackendMixin.forward_unified` (installed as `forward_core_compressor` and
    `forward_indexer_compressor`): one fused launch at a decode step, upstream's method otherwise."""
    why = decline(self, x, forward_batch, compressor)
    call: Call | str | None = None
    if why is None:
        call = gather(self, x, layer_id, compressor)
        why = call if isinstance(call, str) else call.problem()
    if why is not None or not isinstance(call, Call):
        upstream_forward_unified()(self, x, forward_batch, layer_id, compressor)
        return None
    call.run()
    return None
