"""Exact reference of the indexer top-K transform, from its definition, plus test inputs.

Definition (per row b, K = out.shape[1], n = seq_lens[b], W = scores.shape[1], G = 2K):
- n <= K: positions 0 .. n-1, then -1 (empty for n <= 0); the scores are not consulted.
- otherwise, over the first L = min(n, W) scores (L <= K: as above with L): rank positions by
  score in the total order of fp32 bit patterns (-0.0 below +0.0, -inf below every finite value
  and +inf above, a NaN with the sign bit clear above +inf and one with it set below -inf), equal
  scores by the output order below; keep the best K, listed in the output order: by
  (p % G, p // G), column-major over rows of G positions (ascending position when L <= G).
- each position p becomes `(page_table[b, p >> s] << s) | (p & (2^s - 1))`, s = log2(page_size),
  in int32 (two's-complement wrap); a column past the table reads as 0.

The ranking is done with exact integers (int64 keys and stable sorts), no floating point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch

MASK32 = (1 << 32) - 1


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32): larger = better, the IEEE total order on the fp32 bit patterns."""
    u = scores.contiguous().view(torch.int32).to(torch.int64) & MASK32
    neg = u >= (1 << 31)
    return torch.where(neg, MASK32 - u, u + (1 << 31))


def output_rank(pos: torch.Tensor, k: int) -> torch.Tensor:
    """Where position p comes in the output order: column-major over rows of 2K, (p % 2K, p // 2K)."""
    g = 2 * k
    return (pos % g) * (1 << 32) + pos // g


def select_positions(scores_row: torch.Tensor, n: int, k: int) -> List[int]:
    """The selected positions of one row in output order, or the sequential ones of a short row."""
    w = scores_row.shape[0]
    if n <= k:
        return list(range(max(n, 0)))
    length = min(n, w)
    if length <= k:
        return list(range(length))
    key = order_keys(scores_row[:length].cpu())
    pos = torch.arange(length, dtype=torch.int64)
    rank = output_rank(pos, k)
    by_rank = torch.argsort(rank, stable=True)  # output order first, so the key sort keeps it for ties
    best = by_rank[torch.argsort(key[by_rank], descending=True, stable=True)[:k]]
    return pos[best[torch.argsort(rank[best])]].tolist()


def translate(page_row: torch.Tensor, positions: Sequence[int], page_bits: int) -> List[int]:
    """Page indices of `positions` (int32 wrap; a column past the table reads as 0)."""
    pos = torch.tensor(list(positions), dtype=torch.int64)
    cols = pos >> page_bits
    inside = cols < page_row.shape[0]
    page = torch.where(inside, page_row.to(torch.int64)[cols.clamp(max=max(page_row.shape[0] - 1, 0))], 0)
    v = ((page << page_bits) | (pos & ((1 << page_bits) - 1))) & MASK32
    return torch.where(v >= 1 << 31, v - (1 << 32), v).tolist()


def topk_transform_ref(
    scores: torch.Tensor, seq_lens: torch.Tensor, page_tables: torch.Tensor, k: int, page_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(page indices, raw positions), both `[B, k]` int32 on the CPU."""
    bits = page_size.bit_length() - 1
    B = scores.shape[0]
    pages = torch.full((B, k), -1, dtype=torch.int32)
    raw = torch.full((B, k), -1, dtype=torch.int32)
    sc, sl, pt = scores.cpu(), seq_lens.cpu(), page_tables.cpu()
    for b in range(B):
        sel = select_positions(sc[b], int(sl[b]), k)
        if sel:
            raw[b, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
            pages[b, : len(sel)] = torch.tensor(translate(pt[b], sel, bits), dtype=torch.int32)
    return pages, raw


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class TopkCase:
    """One batch of rows. `lengths` are the first rows' seq_lens; the rest repeat the last one."""

    batch: int
    width: int  # scores.shape[1]
    lengths: Sequence[int]
    k: int = 512
    page_size: int = 64
    pattern: str = "normal"  # see make_scores
    table_cols: int | None = None  # default: enough pages for `width`
    score_pad: int = 0  # extra columns of the scores' storage (row stride = width + score_pad)
    table_pad: int = 0  # extra columns of the page table's storage (row stride > table_cols)
    specials: Tuple[Tuple[int, int, float], ...] = field(default_factory=tuple)  # (row, pos, value)


def make_scores(pattern: str, batch: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Scores of one named shape: what indexer logits look like, and what breaks a select.

    normal: i.i.d. N(0, 1). relu: >= 0 with many exact zeros (a ReLU'd sum). ties: a handful of
    distinct values (ties straddle the K-th). cluster: low noise plus a contiguous run of high
    scores (the recent context). sorted_up / sorted_down: monotone rows (adversarial for bounds).
    tight: all within one ulp-range of 1.0 (radix bins that stay full). const: one value.
    """
    if pattern == "normal":
        return torch.randn((batch, width), generator=g)
    if pattern == "relu":
        return torch.relu(torch.randn((batch, width), generator=g) - 1.0)
    if pattern == "ties":
        return torch.randint(0, 7, (batch, width), generator=g).float() * 0.5
    if pattern == "cluster":
        s = torch.randn((batch, width), generator=g) * 0.1
        run = max(1, width // 8)
        s[:, width - 2 * run: width - run] += 5.0 + torch.rand((batch, run), generator=g)
        return s
    if pattern == "sorted_up":
        return torch.sort(torch.randn((batch, width), generator=g), dim=1).values
    if pattern == "sorted_down":
        return torch.sort(torch.randn((batch, width), generator=g), dim=1, descending=True).values
    if pattern == "tight":
        base = torch.tensor(1.0).view(torch.int32).item()
        return (base + torch.randint(0, 64, (batch, width), generator=g, dtype=torch.int32)).view(torch.float32)
    if pattern == "const":
        return torch.full((batch, width), 0.25)
    raise ValueError(f"unknown score pattern {pattern!r}")


def make_topk_inputs(case: TopkCase, seed: int = 0, device: str = "cpu") -> Dict[str, Any]:
    """Positional kwargs of `topk_transform_512` (outputs poisoned with a sentinel that no valid
    index or -1 equals)."""
    g = torch.Generator().manual_seed(seed)
    lens = list(case.lengths) + [case.lengths[-1]] * (case.batch - len(case.lengths))
    storage = make_scores(case.pattern, case.batch, case.width + case.score_pad, g)
    for r, p, val in case.specials:
        storage[r, p] = val
    scores = storage[:, : case.width]
    cols = case.table_cols if case.table_cols is not None else max(1, -(-case.width // case.page_size))
    pt_store = torch.randint(0, 1 << 20, (case.batch, cols + case.table_pad), generator=g, dtype=torch.int32)
    page_table = pt_store[:, :cols]
    seq = torch.tensor(lens[: case.batch], dtype=torch.int32)
    out = torch.full((case.batch, case.k), -7, dtype=torch.int32)
    raw = torch.full((case.batch, case.k), -7, dtype=torch.int32)
    kw = {"scores": scores, "seq_lens": seq, "page_tables": page_table, "out_page_indices": out,
          "page_size": case.page_size, "out_raw_indices": raw}
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


POISON = -7
