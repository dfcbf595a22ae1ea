"""Host side of the indexer top-K transform: configs, the shape-only planner, the drop-in entry.

`topk_transform_512` replaces sglang 0.5.13.post1's `sglang.jit_kernel.dsv4.topk_transform_512`
(the JIT `topk_v1.cuh`; what `layers/attention/dsv4/indexer.py` calls on sm_120, where
`SGLANG_OPT_USE_TOPK_V2` is forced off): same positional signature and defaults, the same checks,
the same outputs written in place (`out_page_indices` and, if given, `out_raw_indices`, both
`[B, K]` int32 with K = out_page_indices.shape[1] in {512, 1024}).

What a row gets (upstream's contract, read from `topk_v1.cuh`):
- `seq_len <= K`: positions 0 .. seq_len-1 in order, then -1; the scores are not read (a -inf or
  NaN score inside the length is still a valid position).
- `seq_len > K`: the K positions of the first seq_len scores with the largest keys, all valid:
  no -inf filtering (a -inf score is a position like any other), the key being upstream's
  `convert_to_uint32` of the fp32 bits (so -0.0 ranks below +0.0, a NaN with the sign bit clear
  above +inf).
- page form: `(page_table[p >> log2(page_size)] << log2(page_size)) | (p & (page_size - 1))`.

What upstream leaves unspecified, this op fixes (deterministic, the same at any batch size):
- order: upstream writes the selected positions in shared-memory atomic arrival order (it changes
  run to run). Here: column-major over rows of 2K positions, i.e. by (p % 2K, p // 2K) — ascending
  position whenever seq_len <= 2K (1024 c4 positions, 4K tokens, at K = 512). Nothing downstream
  depends on the order: the sparse attention reduces over the set, hisparse and the indexer
  capturer take the set.
- ties at the K-th key: upstream keeps whichever tied positions arrive first; here the first in
  the output order.
- upstream's refinement keeps at most 8192 scores of its first 8-bit bin, so a row with more than
  8192 scores in the bin of the K-th can lose some of the true top K; here the select is exact.
- NaN: upstream's first pass bins by the half-precision conversion of the score (CUDA's NaN
  encoding there decides where a NaN with the sign bit set lands); here the fp32 key alone
  decides, so such a NaN ranks below -inf. Indexer logits are not NaN for finite inputs.
- inputs upstream does not define: a row's scores past `scores.shape[1]` (seq_len > the width,
  which SGLang never passes: its logits are `page_table.shape[1] * c4_page_size` wide) are not
  read, the row selects among the first `scores.shape[1]` (upstream reads past the row);
  page-table columns past the table read as 0 (upstream reads past it); a negative seq_len is an
  empty row (upstream takes it as a huge unsigned length); B = 0 is a no-op (upstream launches an
  empty grid).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Tuple

import torch

from v4flash_kernels.kit.device import num_sms
from v4flash_kernels.topk import kernel as _k

TOPKS = (512, 1024)


@dataclass(frozen=True)
class TopkConfig:
    """One compiled variant of `topk_transform_kernel` plus how many programs per SM to launch."""

    num_warps: int
    cap: int = 1024  # candidate slots per program at K = 512 (scaled with K); 600-750 are typical
    small: int = 32  # the bound stops once the bin of the K-th column max holds <= small maxima
    ctas_per_sm: int = 1

    @property
    def name(self) -> str:
        return f"w{self.num_warps}_cap{self.cap}_m{self.small}_p{self.ctas_per_sm}"


# Every config the dispatcher may launch (check_sm120 compiles each for sm_120 and sm_90).
CONFIGS = (TopkConfig(num_warps=8),)
DEFAULT = CONFIGS[0]

# Candidates the benchmark times next to the default (`--sweep`); one may only ship after
# `check_sm120` passes it (16 warps spill 16 B on both arches today).
SWEEP = (
    TopkConfig(num_warps=8, small=8),
    TopkConfig(num_warps=8, small=128),
    TopkConfig(num_warps=8, cap=2048),
    TopkConfig(num_warps=4),
    TopkConfig(num_warps=16),
)
SPEC_MAX_ROWS = 64  # decode-sized batches: load each row's first 2K scores before its seq_len
PT_PREFETCH = 1024  # most page-table columns a row prefetches (1024 x 64 = 64K positions)


def speculate(batch: int, k: int) -> bool:
    """Load each row's first 2K scores together with its seq_len: decode-sized batches at K = 512
    (at K = 1024 the extra [2K, 2] tile would spill on sm_120; prefill rows are mostly short)."""
    return k == 512 and batch <= SPEC_MAX_ROWS


def launch_variants() -> Tuple[Tuple[int, bool, int], ...]:
    """(K, SPEC, PTB) of every binary the planner can launch, at the largest PTB of each kind
    (a smaller prefetch only shrinks the tile): what check_sm120 compiles."""
    return tuple((k, spec, ptb) for k in TOPKS for spec in sorted({speculate(1, k), False})
                 for ptb in ((PT_PREFETCH, 0) if k == 512 else (0,)))


def aux_words(width: int, k: int) -> int:
    """int32 words of a program's long-row workspace: the max of every (tile, column) of the
    widest row and as many (column, tile) pair slots (the kernel's AUX layout)."""
    g = 2 * k
    return max(1, 2 * -(-width // (g * _k.TILE_ROWS)) * g)


def programs(batch: int, num_sms: int, cfg: TopkConfig) -> int:
    """Persistent programs: one per row up to `ctas_per_sm` per SM (from shapes only: graph-safe)."""
    return max(1, min(batch, num_sms * cfg.ctas_per_sm))



def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _require(cond: bool, msg: str) -> None:
    # upstream's TensorMatcher / RuntimeCheck failures (raised from C++ as a RuntimeError)
    if not cond:
        raise RuntimeError(msg)


def _int32_matrix(t: torch.Tensor, name: str, rows: int, cols: int | None = None) -> None:
    """[rows, cols or any] int32, contiguous in its last dim (and in full when `cols` is given)."""
    want = f"[{rows}, {cols if cols is not None else '*'}]"
    _require(t.dim() == 2 and t.shape[0] == rows and (cols is None or t.shape[1] == cols),
             f"{name} must be {want}, got {tuple(t.shape)}")
    _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _require(t.is_contiguous() if cols is not None else t.stride(1) == 1 or t.shape[1] <= 1,
             f"{name} must be contiguous" + ("" if cols is not None else " in its last dim"))


def check_args(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: torch.Tensor | None,
) -> Tuple[int, int]:
    """Upstream's checks, in its order; returns (K, log2(page_size))."""
    k = out_page_indices.shape[1] if out_page_indices.dim() == 2 else -1
    assert k in TOPKS, "Only support topk=512 or 1024"  # the wrapper's assert (before any JIT)
    _require(scores.dim() == 2, f"scores must be [B, *], got {tuple(scores.shape)}")
    B = scores.shape[0]
    _require(scores.dtype == torch.float32, f"scores must be float32, got {scores.dtype}")
    _require(scores.stride(1) == 1 or scores.shape[1] <= 1, "scores must be contiguous in its last dim")
    _require(seq_lens.dim() == 1 and seq_lens.shape[0] == B, f"seq_lens must be [{B}], got {tuple(seq_lens.shape)}")
    _require(seq_lens.dtype == torch.int32, f"seq_lens must be int32, got {seq_lens.dtype}")
    _require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    _int32_matrix(page_tables, "page_table", B)
    _int32_matrix(out_page_indices, "page_indices", B, k)
    if out_raw_indices is not None:
        _int32_matrix(out_raw_indices, "raw_indices", B, k)
    tensors = [scores, seq_lens, page_tables, out_page_indices]
    if out_raw_indices is not None:
        tensors.append(out_raw_indices)
    dev = scores.device
    _require(all(t.device == dev for t in tensors), "all tensors must be on one device")
    _require(dev.type == "cuda" or _interpreting(), f"tensors must be on a CUDA device, got {dev}")
    page_size = int(page_size)
    _require(page_size > 0 and page_size & (page_size - 1) == 0, "page_size must be power of 2")
    return k, page_size.bit_length() - 1


def table_prefetch(width: int, k: int, page_bits: int) -> int:
    """Page-table columns each row prefetches (a power of two covering every column a position
    below max(width, K) can name), or 0 to read the table at the end instead (also at K = 1024,
    where the prefetched row would spill on sm_120)."""
    cols = -(-max(width, k) >> page_bits)
    return 0 if cols > PT_PREFETCH or k != 512 else max(32, 1 << (cols - 1).bit_length())


def run(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: torch.Tensor | None = None,
    config: TopkConfig | None = None,
    nprog: int | None = None,
) -> None:
    """The transform with an optional explicit config / program count (benchmark and tests)."""
    k, page_bits = check_args(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)
    B = scores.shape[0]
    if B == 0:
        return
    cfg = config or DEFAULT
    cap = cfg.cap * k // 512
    if not 0 < cap < 1 << 16 or cap & (cap - 1):
        raise ValueError(f"config {cfg.name}: cap must be a power of two below 65536")
    dev = scores.device
    if nprog is None:
        nprog = programs(B, num_sms(dev), cfg)
    W = scores.shape[1]
    ws = torch.empty((nprog, cap + 1), dtype=torch.int64, device=dev)
    aux = torch.empty((nprog, aux_words(W, k)), dtype=torch.int32, device=dev)
    raw = out_raw_indices if out_raw_indices is not None else out_page_indices
    _k.topk_transform_kernel[(nprog,)](
        scores, scores.stride(0),
        seq_lens,
        page_tables, page_tables.stride(0), page_tables.shape[1],
        out_page_indices, raw, ws, aux,
        B, W, page_bits,
        K=k,
        CAP=cap,
        SMALL=cfg.small,
        SPEC=speculate(B, k),
        PTB=table_prefetch(W, k, page_bits),
        HAS_RAW=out_raw_indices is not None,
        num_warps=cfg.num_warps,
    )


def topk_transform_512(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: torch.Tensor | None = None,
) -> None:
    """Top-K (K = out_page_indices.shape[1]) of each row's first seq_len scores, as page indices.

    Same contract as sglang 0.5.13.post1 `sglang.jit_kernel.dsv4.topk_transform_512` (module
    docstring: what it fixes where upstream's is unspecified).
    """
    run(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)
