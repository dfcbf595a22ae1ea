"""Host side of the indexer top-K transform: configs, the shape-only planner, the drop-in entry.

`topk_transform_512` replaces sglang 0.5.13.post1's `jit_kernel/dsv4/topk.py::topk_transform_512`
(the JIT `topk_v1.cuh`, what `layers/attention/dsv4/indexer.py` calls on sm_120, where
`SGLANG_OPT_USE_TOPK_V2` is forced off): same positional signature and defaults, the same checks,
the same outputs written in place (`out_page_indices` and, if given, `out_raw_indices`, both
`[B, K]` int32 with K = out_page_indices.shape[1] in {512, 1024}).

What a row gets (upstream's contract, read from `topk_v1.cuh`):
- `seq_len <= K`: positions 0 .. seq_len-1 in order, then -1; the scores are not read (a -inf or
  NaN score inside the length is still a valid position).
- `seq_len > K`: the K positions of the first seq_len scores with the largest keys, all valid:
  no -inf filtering (a -inf score is a position like any other), the key being upstream's
  `convert_to_uint32` of the fp32 bits (so -0.0 ranks below +0.0 and a positive NaN above +inf).
- page form: `(page_table[p >> log2(page_size)] << log2(page_size)) | (p & (page_size - 1))`.

Where upstream leaves something unspecified, this op fixes it (documented, deterministic):
- order: upstream writes the selected positions in shared-memory atomic arrival order (it changes
  run to run); here always ascending position. Nothing downstream depends on the order (the
  sparse attention reduces over the set; hisparse swaps in the set).
- ties at the K-th key: upstream keeps whichever tied positions arrive first; here the lowest.
- upstream's refinement keeps at most 8192 scores of its first 8-bit bin, so a row with more than
  8192 scores in the bin of the K-th can lose some of the true top K; here the select is exact.
- NaN: upstream's first pass bins by the half-precision value, where every NaN (either sign)
  lands above +inf; here the fp32 key alone decides, so a NaN with the sign bit set ranks below
  -inf. Indexer logits are never NaN for finite inputs.
- scores past the row's width (seq_len > scores.shape[1], which SGLang never passes: the logits
  are `page_table.shape[1] * c4_page_size` wide) are never read: the row selects among the first
  `scores.shape[1]` (upstream reads past the row); page-table columns past the table read as 0;
  a negative seq_len is an empty row; B = 0 is a no-op (upstream launches an empty grid).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

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
# `check_sm120` passes it.
SWEEP = tuple(
    TopkConfig(num_warps=w, small=m, ctas_per_sm=p)
    for w in (4, 8, 16)
    for m in (8, 32)
    for p in (1, 2)
)
SPEC_MAX_ROWS = 64  # decode-sized batches: load each row's first 2K scores before its seq_len
PT_PREFETCH = 1024  # page-table columns prefetched per row when the scores need no more


def programs(batch: int, num_sms: int, cfg: TopkConfig) -> int:
    """Persistent programs: one per row up to `ctas_per_sm` per SM (from shapes only: graph-safe)."""
    return max(1, min(batch, num_sms * cfg.ctas_per_sm))


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    """SM count, cached per device; host-only (no sync), so safe during CUDA-graph capture."""
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _require(cond: bool, msg: str) -> None:
    # upstream's TensorMatcher / RuntimeCheck failures (raised from C++ as a RuntimeError)
    if not cond:
        raise RuntimeError(msg)


def _matrix(t: torch.Tensor, name: str, rows: int, cols: Optional[int] = None, contiguous: bool = False) -> None:
    _require(t.dim() == 2 and t.shape[0] == rows and (cols is None or t.shape[1] == cols),
             f"{name} must be [{rows}, {cols if cols is not None else '*'}], got {tuple(t.shape)}")
    _require(t.dtype == torch.int32 or name == "scores", f"{name} must be int32, got {t.dtype}")
    _require(t.shape[1] <= 1 or t.stride(1) == 1, f"{name} must be contiguous in its last dim")
    if contiguous:
        _require(t.is_contiguous(), f"{name} must be contiguous")


def check_args(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: Optional[torch.Tensor],
) -> Tuple[int, int]:
    """Upstream's checks, in its order; returns (K, log2(page_size))."""
    _ = scores, seq_lens, page_tables
    k = out_page_indices.shape[1] if out_page_indices.dim() == 2 else -1
    assert k in TOPKS, "Only support topk=512 or 1024"  # the wrapper's assert (before any JIT)
    _require(scores.dim() == 2, f"scores must be [B, *], got {tuple(scores.shape)}")
    B = scores.shape[0]
    _require(scores.dtype == torch.float32, f"scores must be float32, got {scores.dtype}")
    _matrix(scores, "scores", B)
    _require(seq_lens.dim() == 1 and seq_lens.shape[0] == B, f"seq_lens must be [{B}], got {tuple(seq_lens.shape)}")
    _require(seq_lens.dtype == torch.int32, f"seq_lens must be int32, got {seq_lens.dtype}")
    _require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    _matrix(page_tables, "page_table", B)
    _matrix(out_page_indices, "page_indices", B, k, contiguous=True)
    if out_raw_indices is not None:
        _matrix(out_raw_indices, "raw_indices", B, k, contiguous=True)
    tensors = [scores, seq_lens, page_tables, out_page_indices] + ([out_raw_indices] if out_raw_indices is not None
                                                                   else [])
    dev = scores.device
    _require(all(t.device == dev for t in tensors), "all tensors must be on one device")
    _require(dev.type == "cuda" or _interpreting(), f"tensors must be on a CUDA device, got {dev}")
    page_size = int(page_size)
    _require(page_size > 0 and page_size & (page_size - 1) == 0, "page_size must be power of 2")
    return k, page_size.bit_length() - 1


def run(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: Optional[torch.Tensor] = None,
    config: Optional[TopkConfig] = None,
    nprog: Optional[int] = None,
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
        nprog = programs(B, _num_sms(dev), cfg)
    W = scores.shape[1]
    tile = 2 * k * 8
    ws = torch.empty((nprog, cap + 1), dtype=torch.int64, device=dev)
    aux = torch.empty((nprog, max(1, 2 * -(-W // tile) * 2 * k)), dtype=torch.int32, device=dev)
    pages_needed = min(page_tables.shape[1], -(-W >> page_bits) if W else 0)
    ptb = 0 if pages_needed > PT_PREFETCH else max(16, 1 << max(pages_needed - 1, 0).bit_length())
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
        SPEC=B <= SPEC_MAX_ROWS,
        PTB=ptb,
        HAS_RAW=out_raw_indices is not None,
        num_warps=cfg.num_warps,
    )


def topk_transform_512(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: Optional[torch.Tensor] = None,
) -> None:
    """Top-K (K = out_page_indices.shape[1]) of each row's first seq_len scores, as page indices.

    Same contract as sglang 0.5.13.post1 `sglang.jit_kernel.dsv4.topk_transform_512` (module
    docstring: what it fixes where upstream's is unspecified).
    """
    run(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)
