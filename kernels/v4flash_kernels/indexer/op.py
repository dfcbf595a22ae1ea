"""Host side of the fused lightning-indexer logits: configs, the grid planner, the drop-in entry.

`fp8_paged_mqa_logits` replaces sglang 0.5.13.post1's
`layers/attention/dsv4/indexer.py::fp8_paged_mqa_logits_torch_sm120`: same positional signature
and defaults, same checks, same output (`[B, max_seq_len]` fp32 logits, -inf at every position
>= the row's `seq_lens`, `seq_lens` given as `[B]` or `[B, 1]`, `deep_gemm_metadata` ignored,
`clean_logits` must be False). Upstream gathers and multiplies *every* page of the table (the
configured context under CUDA graphs); this kernel reads only the pages below each row's length,
so its cost follows the real context, and writes -inf over the rest of the row.

Why a shape-only planner: the number of programs per row must not depend on `seq_lens` (device
data), so a CUDA graph captured once replays correctly for any lengths, and every launchable
config is known ahead of time so `check_sm120` can prove it fits sm_120.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton

from v4flash_kernels.indexer import kernel as _k
from v4flash_kernels.kit.device import num_sms

PAGE = int(_k.PAGE)
HEAD_DIM = int(_k.HEAD_DIM)


@dataclass(frozen=True)
class IndexerConfig:
    """One compiled variant of `indexer_logits_kernel` plus how many programs per SM to aim for."""

    pages: int  # pages (64 positions each) per tile: one tl.dot of [64*pages, 128] x [128, heads]
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 4
    ctas_per_sm_big: int = 0  # programs per SM from BIG_BATCH rows on (0 = ctas_per_sm)
    fill: int = 2048  # positions per -inf store in the tail
    shared_bytes: int = 0  # compiled shared memory on sm_120 (0 = not recorded); check_sm120 verifies

    @property
    def name(self) -> str:
        fill = "" if self.fill == 2048 else f"_f{self.fill}"
        big = f"_b{self.ctas_per_sm_big}" if self.ctas_per_sm_big else ""
        return f"p{self.pages}_w{self.num_warps}_s{self.num_stages}_c{self.ctas_per_sm}{big}{fill}"


# Every config the dispatcher may launch (check_sm120 compiles each for sm_120 and sm_90).
# The shipped one, from the H200 sweeps of 2026-11-30 (kernels/BENCH.md, "Indexer"): 64-position
# tiles, 4 warps, no software pipelining, 8 programs per SM; from 64 rows on, 16 per SM (B=64 at
# 128K actual: 150 us vs 184 us with 8; everything below 64 rows was as fast or faster with 4-8).
CONFIGS = (
    IndexerConfig(pages=1, num_warps=4, num_stages=1, ctas_per_sm=8, ctas_per_sm_big=16),
    IndexerConfig(pages=2, num_warps=8, num_stages=1, ctas_per_sm=4),
)
DEFAULT = CONFIGS[0]
BIG_BATCH = 64

# Candidates the benchmark times next to the table (`--sweep`); one may only ship after
# `check_sm120` passes it. Round 2 on the H200: 8 warps per 64-position tile and Triton's own
# pipelining (num_stages 2-3) were slower everywhere; round 3: the register prefetch, 2- and
# 4-page tiles were no faster than single-page tiles (kernels/BENCH.md). The register prefetch
# needs its own kernel path: kernels/scripts/indexer_variants.py times it.
SWEEP = tuple(
    IndexerConfig(pages=p, num_warps=w, num_stages=1, ctas_per_sm=c)
    for p, w in ((1, 4), (2, 4), (2, 8), (4, 8))
    for c in (4, 8, 16, 32)
) + (
    IndexerConfig(pages=1, num_warps=4, num_stages=2, ctas_per_sm=16),
    DEFAULT,
)


def programs_per_row(batch: int, max_pages: int, num_sms: int, cfg: IndexerConfig) -> int:
    """Programs per row: about `ctas_per_sm` per SM over the batch, never more than the row's tiles."""
    tiles = max(1, math.ceil(max_pages / cfg.pages))
    per_sm = cfg.ctas_per_sm_big if cfg.ctas_per_sm_big and batch >= BIG_BATCH else cfg.ctas_per_sm
    return max(1, min(tiles, math.ceil(num_sms * per_sm / max(1, batch))))



def _check(cond: bool, msg: str) -> None:
    # Upstream's own asserts, raised even under `python -O` (same exception type as upstream).
    if not cond:
        raise AssertionError(msg)


def run(
    q_fp8: torch.Tensor,
    kvcache_fp8: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_seq_len: int,
    config: IndexerConfig | None = None,
    nprog: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits with an optional explicit config / programs per row (benchmark and tests).

    `out` ([B, max_seq_len] fp32, last dim contiguous) may be given so tests can poison it and prove
    every element is written.
    """
    batch, _, num_heads, head_dim = q_fp8.shape
    block_size = kvcache_fp8.shape[1]
    _check(head_dim == HEAD_DIM, "Vectorized torch impl hardcodes DSV4 indexer head_dim=128")
    _check(block_size == PAGE, "Vectorized torch impl hardcodes block_size=64 cache layout")
    _check(q_fp8.shape == (batch, 1, num_heads, head_dim), "q_fp8 must be [B, 1, H, 128]")
    _check(kvcache_fp8.shape[1:] == (block_size, 1, head_dim + 4), "kvcache_fp8 must be [P, 64, 1, 132]")
    _check(weight.shape == (batch, num_heads), "weight must be [B, H]")
    if seq_lens.dim() > 1:
        seq_lens = seq_lens.squeeze(-1)
    _check(seq_lens.shape == (batch,), "seq_lens must be [B] or [B, 1]")
    _check(page_table.shape[0] == batch, "page_table must have B rows")
    max_seq_len = int(max_seq_len)
    max_pages = (max_seq_len + PAGE - 1) // PAGE
    if page_table.shape[1] < max_pages:
        # Upstream's gather of page_table[:, :max_pages] cannot be viewed as max_pages pages either.
        raise RuntimeError(
            f"page_table has {page_table.shape[1]} columns, max_seq_len {max_seq_len} needs {max_pages}"
        )
    if kvcache_fp8.element_size() != 1:
        raise TypeError(f"kvcache_fp8 must be a 1-byte dtype (uint8 / float8), got {kvcache_fp8.dtype}")

    dev = q_fp8.device
    if out is None:
        out = torch.empty((batch, max_seq_len), dtype=torch.float32, device=dev)
    if batch == 0 or max_seq_len == 0:
        return out
    num_pages = kvcache_fp8.shape[0]
    flat = kvcache_fp8.view(-1, block_size * (head_dim + 4)).view(torch.uint8)  # upstream's view
    k8 = flat.view(torch.float8_e4m3fn)
    ks = flat.view(torch.float32)
    q = q_fp8 if q_fp8.stride(3) == 1 else q_fp8.contiguous()
    # fp16 operands when q is fp8 (exact); fp32 for another q dtype and under the interpreter.
    dot_f16 = q.dtype == torch.float8_e4m3fn and os.environ.get("TRITON_INTERPRET") != "1"

    cfg = config or DEFAULT
    if nprog is None:
        nprog = programs_per_row(batch, max_pages, num_sms(dev), cfg)
    block_h = max(16, triton.next_power_of_2(num_heads))
    _k.indexer_logits_kernel[(nprog, batch)](
        q, q.stride(0), q.stride(2),
        k8, ks, k8.stride(0), ks.stride(0),
        weight, weight.stride(0), weight.stride(1),
        seq_lens, seq_lens.stride(0),
        page_table, page_table.stride(0),
        out, out.stride(0),
        num_heads, max_seq_len, num_pages,
        BLOCK_H=block_h,
        PAGES=cfg.pages,
        FILL=cfg.fill,
        DOT_F16=dot_f16,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def fp8_paged_mqa_logits(
    q_fp8: torch.Tensor,
    kvcache_fp8: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    deep_gemm_metadata: Any,
    max_seq_len: int,
    clean_logits: bool = True,
) -> torch.Tensor:
    """Indexer logits `[B, max_seq_len]` fp32; cost follows `seq_lens`, not the table width.

    Same contract as sglang 0.5.13.post1 `fp8_paged_mqa_logits_torch_sm120` (which also asserts
    `clean_logits == False`; SGLang always passes False).
    """
    _ = deep_gemm_metadata
    _check(clean_logits == False, "clean_logits must be False")  # noqa: E712 - upstream's check
    return run(q_fp8, kvcache_fp8, weight, seq_lens, page_table, max_seq_len)
