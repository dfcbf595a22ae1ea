"""Make the decode compute only this attention-TP rank's heads when SGLang calls it.

At attention-TP size N > 1, sglang 0.5.13.post1's DeepSeek-V4 attention hands the kernel a q with
all 64 heads of which only rank r's `64 / N` are real (the rest of the buffer is uninitialised and
may hold NaN/Inf), and keeps only `o[:, r*64/N:(r+1)*64/N]` of the result. Upstream's call does not
pass the rank, so `make_tp_aware` wraps our kernel in a function with upstream's exact signature
that adds `head_range=(start, stop)` for this rank. The range is a per-process fact: it is computed once
(on the first call, when SGLang's process groups exist) and cached, so CUDA-graph capture and
replay see the same value.

When the rank cannot be read (no process group yet, sglang absent), the call computes every head:
that is always correct because the caller slices; a wrong slice would not be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

import torch


@dataclass(frozen=True)
class AttnTp:
    """This process's attention tensor-parallel position (size 1 = all heads are real)."""

    rank: int
    size: int


def heads_for(total_heads: int, tp: AttnTp | None) -> Tuple[int, int] | None:
    """This rank's head range in a q of `total_heads` heads; None = all heads.

    Mirrors the model's `tp_slice = slice(rank * n_local, (rank + 1) * n_local)` with
    `n_local = n_heads // attn_tp_size`; anything that does not divide evenly keeps all heads.
    """
    if tp is None or tp.size <= 1 or total_heads % tp.size or not 0 <= tp.rank < tp.size:
        return None
    n = total_heads // tp.size
    return tp.rank * n, (tp.rank + 1) * n


def read_attn_tp() -> AttnTp | None:
    """SGLang's attention-TP rank and size, or None when they cannot be read yet.

    DSA prefill context parallel makes the DeepSeek-V4 layer run with tp 1 (all heads real, no
    padding) whatever the attention-TP group is, so it counts as size 1 here too.
    """
    try:
        from sglang.srt.layers.dp_attention import get_attention_tp_rank, get_attention_tp_size

        rank, size = int(get_attention_tp_rank()), int(get_attention_tp_size())
    except Exception:
        return None
    if size > 1 and _prefill_cp_enabled():
        return AttnTp(0, 1)
    return AttnTp(rank, size)


def _prefill_cp_enabled() -> bool:
    try:
        from sglang.srt.layers.attention.dsa.utils import is_dsa_enable_prefill_cp

        return bool(is_dsa_enable_prefill_cp())
    except Exception:
        return False


def make_tp_aware(ours: Callable[..., Any], read: Callable[[], AttnTp | None] = read_attn_tp) -> Callable[..., Any]:
    """A drop-in with upstream's exact signature that passes this rank's `heads` to `ours`.

    `ours` must accept `head_range=(start, stop)` as a keyword (v4flash_kernels.attention.op.sparse_mla_decode).
    `read` is how the rank is found (tests pass a fake); it is retried until it gives an answer,
    then never again in this process.
    """
    cached: List[AttnTp] = []

    def rank() -> AttnTp | None:
        if not cached:
            tp = read()
            if tp is None:
                return None
            cached.append(tp)
        return cached[0]

    def flash_mla_sparse_decode_triton(
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
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """v4flash_kernels' sparse-MLA decode, computing only this attention-TP rank's heads."""
        out: Tuple[torch.Tensor, torch.Tensor] = ours(
            q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
            extra_k_cache, extra_indices, extra_topk_length, head_range=heads_for(q.shape[-2], rank()),
        )
        return out

    flash_mla_sparse_decode_triton.v4flash_attn_tp = rank  # type: ignore[attr-defined]  # for status/tests
    flash_mla_sparse_decode_triton.v4flash_ours = ours  # type: ignore[attr-defined]  # what it wraps
    return flash_mla_sparse_decode_triton
