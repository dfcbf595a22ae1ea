"""Upstream's block-FP8 linear on sm_120, loaded from the pinned sglang wheel at run time (the baseline of
the self-check, the bench and the tests): `triton_w8a8_block_fp8_linear` over its Triton activation quant
and `w8a8_block_fp8_matmul_triton`.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Dict

from v4flash_kernels import upstream as _up

FP8_UTILS_PATH = "sglang/srt/layers/quantization/fp8_utils.py"

_FP8_KERNEL_DEFS = ("_per_token_group_quant_8bit", "_per_token_group_quant_8bit_colmajor",
                    "create_per_token_group_quant_fp8_output_scale", "_per_token_group_quant_8bit_raw",
                    "_w8a8_block_fp8_matmul", "prepare_block_fp8_matmul_inputs", "w8a8_block_fp8_matmul_triton")
# Names the extracted bodies use. The config lookup returns None: no tuned JSON, the default config
# (what runs on the RTX PRO 6000); `_is_hip` False and e4m3fn: the CUDA branches.
_FP8_KERNEL_PRELUDE = """
from typing import Any, Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

_is_hip = False
fp8_dtype = torch.float8_e4m3fn


def ceil_align(x, y):
    return (x + y - 1) // y * y


def get_w8a8_block_fp8_configs(N, K, block_n, block_k):
    return None


def select_w8a8_block_fp8_matmul_kernel(M, N, META):
    return _w8a8_block_fp8_matmul
"""
_loaded: Dict[str, ModuleType] = {}


def upstream_fp8_kernel() -> ModuleType:
    """Upstream's Triton activation quant and block-FP8 GEMM (`fp8_kernel.py`), verbatim from the wheel."""
    if "kernel" not in _loaded:
        _loaded["kernel"] = _up.load_defs(_up.FP8_KERNEL_PATH, _FP8_KERNEL_DEFS, _FP8_KERNEL_PRELUDE)
    return _loaded["kernel"]


def upstream_fp8_linear() -> ModuleType:
    """Upstream's `triton_w8a8_block_fp8_linear` (`fp8_utils.py`) verbatim, over `upstream_fp8_kernel`'s
    quant (SGLang's non-sgl-kernel `per_token_group_quant_fp8`) and GEMM."""
    if "linear" not in _loaded:
        k = upstream_fp8_kernel()
        sys.modules.setdefault(k.__name__, k)
        prelude = ("from typing import List, Optional\n\nimport torch\n\n"
                   f"from {k.__name__} import _per_token_group_quant_8bit_raw as per_token_group_quant_fp8\n"
                   f"from {k.__name__} import w8a8_block_fp8_matmul_triton\n")
        _loaded["linear"] = _up.load_defs(FP8_UTILS_PATH, ("triton_w8a8_block_fp8_linear",), prelude)
    return _loaded["linear"]
