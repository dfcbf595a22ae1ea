"""The few SGLang objects `forward_unified` reads, built around plain tensors, so the self-check, the step
bench and the tests call the drop-in exactly as the model does (`backend.forward_core_compressor(x,
forward_batch, layer_id, compressor)`) without a model or a memory pool.

Each stand-in has only the attributes and methods upstream's `forward_unified` and ours use, with
upstream's names and return conventions (`compressor_v2.CompressorBackendMixin`, `Compressor`,
`DeepSeekV4TokenToKVPool`, `CompressorDecodePlan`, `ForwardBatch.forward_mode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict

import torch


@dataclass
class DecodePlan:
    """`sglang.jit_kernel.dsv4.CompressorDecodePlan`: (compress_ratio, plan_d [T, 16] uint8)."""

    compress_ratio: int
    plan_d: torch.Tensor

    @property
    def is_decode(self) -> bool:
        return True


@dataclass
class ForwardMode:
    idle: bool = False

    def is_idle(self) -> bool:
        return self.idle


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode = field(default_factory=ForwardMode)
    attn_cp_metadata: Any = None


class Pool:
    """`DeepSeekV4TokenToKVPool`'s cache lookups for one layer (`layer_id` 0)."""

    def __init__(self, cache: torch.Tensor, page_size: int, ratio: int, indexer: bool) -> None:
        self.cache, self.page_size, self.indexer = cache, page_size, indexer
        self.layer_mapping = [(ratio, 0, SimpleNamespace(page_size=page_size))]

    def get_extra_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.cache

    def get_extra_key_page_size(self, layer_id: int) -> int:
        return self.page_size

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.cache

    def get_index_k_page_size(self) -> int:
        return self.page_size


class Backend:
    """The attention backend as `forward_unified` sees it: its metadata of this step and its pool."""

    def __init__(self, plan: DecodePlan, out_loc: torch.Tensor, pool: Pool) -> None:
        self.plan, self.out_loc, self.token_to_kv_pool = plan, out_loc, pool
        self.enable_deepseek_v4_fp4_indexer = False

    def _get_paged_compress_metadata(self, compress_ratio: int) -> DecodePlan:
        return self.plan

    def _get_out_loc(self, compress_ratio: int) -> torch.Tensor:
        return self.out_loc


class Compressor:
    """`dsv4.compressor.Compressor`'s parameters and state lookup (its `ape` after `apply_ape_hotfix`)."""

    def __init__(self, case: Dict[str, Any], weight: torch.Tensor | None = None) -> None:
        self.ratio, self.head_dim = int(case["ratio"]), int(case["head_dim"])
        self.is_in_indexer = self.rotate = self.head_dim == 128
        coff = 2 if self.ratio == 4 else 1
        self.wkv_gate = SimpleNamespace(weight=case["weight"] if weight is None else weight)
        self.ape = case["ape"].view(self.ratio, coff * self.head_dim)
        self.norm = SimpleNamespace(weight=case["norm_weight"], variance_epsilon=float(case["eps"]))
        self.freqs_cis = case["freqs_cis"]
        self._state = SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=case["state"]))

    def get_state_pool(self, attn_backend: Any) -> Any:
        return self._state


def objects(case: Dict[str, Any], weight: torch.Tensor | None = None) -> Dict[str, Any]:
    """(backend, x, forward_batch, layer_id, compressor) of one call on `reference.make_case`'s tensors."""
    ratio = int(case["ratio"])
    plan = DecodePlan(ratio, case["plan_d"].view(torch.uint8))
    pool = Pool(case["cache"], int(case["page_size"]), ratio, int(case["head_dim"]) == 128)
    return {"self": Backend(plan, case["out_loc"], pool), "x": case["x"], "forward_batch": ForwardBatch(),
            "layer_id": 0, "compressor": Compressor(case, weight)}
