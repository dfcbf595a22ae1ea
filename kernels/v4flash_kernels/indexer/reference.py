"""fp64 reference of the DeepSeek-V4 lightning-indexer logits, plus real-layout random inputs.

The format (SGLang 0.5.13.post1's c4 indexer pool, written by its `fused_store_indexer_cache`):
one page holds 64 compressed positions as `[64 x 128]` fp8 e4m3 key bytes followed by 64 fp32
per-token scales (`max(1e-4, absmax) / 448`), 8448 bytes per page; `page_table[b, j]` names the
physical page of row b's logical page j, and position p of row b lives in slot `p % 64` of page
`page_table[b, p // 64]`. The logit of position p is

    scale[p] * sum_h weight[b, h] * relu(dot(key[p], q[b, h]))

for p < min(seq_len[b], max_seq_len), and -inf for every other column of the `[B, max_seq_len]`
output. A negative page id counts from the end of the pool (torch indexing, what upstream's
gather does). The reference reads the raw bytes itself, independently of the kernel's code path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

import torch

PAGE = 64
HEAD_DIM = 128
PAGE_BYTES = PAGE * (HEAD_DIM + 4)  # 8448
SCALE_OFFSET = PAGE * HEAD_DIM  # byte offset of the 64 fp32 scales in a page
FP8_MAX = 448.0


def page_bytes_view(kvcache: torch.Tensor) -> torch.Tensor:
    """The pool as `[num_pages, 8448]` uint8 (whatever 1-byte dtype / 4-d view it came in)."""
    return kvcache.reshape(kvcache.shape[0], PAGE_BYTES).view(torch.uint8)


def indexer_logits_ref(
    q_fp8: torch.Tensor,
    kvcache_fp8: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_seq_len: int,
) -> torch.Tensor:
    """`[B, max_seq_len]` float64 logits (-inf where invalid), straight from the page bytes.

    Runs on the inputs' device, one row at a time (a GPU keeps the 1M-context benchmark quick).
    """
    raw = page_bytes_view(kvcache_fp8)
    dev = raw.device
    num_pages = raw.shape[0]
    q = q_fp8.reshape(q_fp8.shape[0], -1, HEAD_DIM).to(torch.float64)  # [B, H, D]
    w = weight.to(torch.float64)
    lens = seq_lens.reshape(-1).to(torch.int64).tolist()
    pt = page_table.to(torch.int64)
    B = q.shape[0]
    out = torch.full((B, max_seq_len), float("-inf"), dtype=torch.float64, device=dev)
    for b in range(B):
        n = max(0, min(int(lens[b]), max_seq_len))
        if n == 0:
            continue
        n_pages = math.ceil(n / PAGE)
        page = pt[b, :n_pages]
        page = torch.where(page < 0, page + num_pages, page)
        pages = raw[page]  # [n_pages, 8448] bytes of this row's pages, in logical order
        keys = pages[:, :SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
        keys = keys.reshape(n_pages * PAGE, HEAD_DIM)[:n]
        scales = pages[:, SCALE_OFFSET:].contiguous().view(torch.float32).to(torch.float64).reshape(-1)[:n]
        s = torch.relu(keys @ q[b].T)  # [n, H]
        out[b, :n] = (s @ w[b]) * scales
    return out


def logits_error(out: torch.Tensor, ref: torch.Tensor) -> Dict[str, Any]:
    """Max error over valid positions relative to the largest |logit| of the call, and mask checks.

    `inf_ok`: -inf exactly where the reference is -inf; `nan`: any NaN in `out`.
    """
    r = ref.to(torch.float64)
    o = out.detach().to(device=r.device, dtype=torch.float64)
    nan = bool(torch.isnan(o).any())
    inf_ok = o.shape == r.shape and bool(torch.equal(torch.isneginf(o), torch.isneginf(r)))
    fin = torch.isfinite(r)
    if not inf_ok or not fin.any():
        return {"rel_err": 0.0 if inf_ok and not nan else float("inf"), "inf_ok": inf_ok, "nan": nan}
    scale = r[fin].abs().max().item() or 1.0
    err = (o[fin] - r[fin]).abs().max().item() / scale
    return {"rel_err": err if not nan else float("nan"), "inf_ok": inf_ok, "nan": nan}


# ---------------------------------------------------------------- random real-layout inputs


@dataclass(frozen=True)
class IndexerCase:
    """One indexer call: B rows over a page table of `width` pages (max_seq_len = 64 * width).

    `lengths`: one compressed length per row (cycled over B); None = full width. `pad_rows`: that many
    trailing rows look like SGLang's CUDA-graph padding (seq_len 1, page-table row of zeros).
    `table_pad`: what sits in page-table columns past a row's length: "zeros" (req_to_token's
    untouched slots), "stale" (pages of another request) or "neg" (-1). `max_seq_len`: override
    (must be <= 64 * width), else 64 * width like `PagedIndexerMetadata.max_c4_seq_len`.
    """

    batch: int
    width: int
    heads: int = 64
    lengths: Sequence[int] | None = None
    pad_rows: int = 0
    table_pad: str = "zeros"
    max_seq_len: int | None = None
    extra_table_cols: int = 0
    seq_lens_2d: bool = True  # SGLang passes c4_seq_lens.unsqueeze(-1)
    weight_strided: bool = False  # a non-contiguous [B, H] view (every other element of a wider buffer)
    spare_pages: int = 3
    seq_dtype: torch.dtype = torch.int32

    @property
    def msl(self) -> int:
        return self.max_seq_len if self.max_seq_len is not None else PAGE * self.width


def quantize_keys(k: torch.Tensor) -> Tuple[Any, ...]:
    """What `fused_store_indexer_cache` writes for keys `k` [..., 128]: fp8 values and fp32 scales."""
    amax = k.abs().amax(dim=-1).float()
    scale = torch.clamp(amax, min=1e-4) / FP8_MAX
    vals = (k.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return vals, scale


def make_pool(num_pages: int, gen: torch.Generator, device: str | torch.device = "cpu", chunk: int = 8192) -> torch.Tensor:
    """`[num_pages, 8448]` uint8 pool: keys of varied magnitude quantized like SGLang's store kernel.

    Drawn in chunks of pages on `device` (`gen` must live there) to bound the temporaries.
    """
    pool = torch.empty((num_pages, PAGE_BYTES), dtype=torch.uint8, device=device)
    for p0 in range(0, num_pages, chunk):
        n = min(chunk, num_pages - p0)
        mag = torch.exp(torch.randn((n, PAGE, 1), generator=gen, device=device))
        k = (torch.randn((n, PAGE, HEAD_DIM), generator=gen, device=device) * mag).to(torch.bfloat16)
        vals, scale = quantize_keys(k)
        pool[p0:p0 + n, :SCALE_OFFSET] = vals.view(torch.uint8).reshape(n, SCALE_OFFSET)
        pool[p0:p0 + n, SCALE_OFFSET:] = scale.contiguous().view(torch.uint8).reshape(n, PAGE * 4)
    return pool


def make_indexer_inputs(case: IndexerCase, device: str | torch.device = "cpu", seed: int | None = None) -> Dict[str, Any]:
    """Positional-call kwargs for `fp8_paged_mqa_logits` (and the reference), drawn for `case`.

    Rows draw distinct physical pages from a shared pool in random order, so a kernel that ignores
    the page table or mixes rows up cannot match. Everything is drawn on `device`.
    """
    g = torch.Generator(device=device).manual_seed(seed if seed is not None else torch.seed() % (2**31))
    B, W, H = case.batch, case.width, case.heads
    real = B - case.pad_rows
    msl = case.msl
    if msl > PAGE * W:
        raise ValueError(f"max_seq_len {msl} needs a page table of >= {math.ceil(msl / PAGE)} columns")
    lens = []
    for b in range(B):
        if b >= real:
            lens.append(1)
        elif case.lengths is None:
            lens.append(msl)
        else:
            lens.append(int(case.lengths[b % len(case.lengths)]))
    used = [min(W, max(0, math.ceil(min(n, msl) / PAGE))) for n in lens[:real]]
    num_pages = sum(used) + case.spare_pages + 1
    pool = make_pool(num_pages, g, device)
    perm = (torch.randperm(num_pages - 1, generator=g, device=device) + 1).to(torch.int32)  # page 0: padding
    cols = W + case.extra_table_cols
    table = torch.zeros((B, cols), dtype=torch.int32, device=device)
    start = 0
    for b in range(real):
        n = used[b]
        table[b, :n] = perm[start:start + n]
        start += n
        rest = cols - n
        if rest > 0:
            if case.table_pad == "stale":
                table[b, n:] = torch.randint(0, num_pages, (rest,), generator=g, device=device, dtype=torch.int32)
            elif case.table_pad == "neg":
                table[b, n:] = -1
    q = (torch.randn((B, H, HEAD_DIM), generator=g, device=device) * 2.0).to(torch.float8_e4m3fn)
    wfull = torch.randn((B, H, 2), generator=g, device=device) * 0.05
    weight = wfull[:, :, 0] if case.weight_strided else wfull[:, :, 0].contiguous()
    seq = torch.tensor(lens, dtype=case.seq_dtype, device=device)
    if case.seq_lens_2d:
        seq = seq.unsqueeze(-1)
    return {
        "q_fp8": q.unsqueeze(1),
        "kvcache_fp8": pool.view(num_pages, PAGE, 1, HEAD_DIM + 4),
        "weight": weight,
        "seq_lens": seq,
        "page_table": table,
        "deep_gemm_metadata": None,
        "max_seq_len": msl,
        "clean_logits": False,
    }


def reference_for(kw: Dict[str, Any]) -> torch.Tensor:
    return indexer_logits_ref(kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["seq_lens"],
                              kw["page_table"], kw["max_seq_len"])
