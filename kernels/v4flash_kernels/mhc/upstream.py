"""Upstream's sm_120 mHC boundary, loaded from the pinned sglang wheel at run time (the self-check's
baseline, and the bench's and the tests'): `DeepseekV4DecoderLayer.hc_pre` (torch fp32 GEMV + RMS, the
TileLang `hc_split_sinkhorn`, torch combine) and `hc_post` (TileLang `mhc_post`), and the gated-off
TileLang `mhc_fused_post_pre`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Any, Callable, Iterator

import torch

from v4flash_kernels import upstream as _up
from v4flash_kernels.mhc import reference as R

MODEL_PATH = "sglang/srt/models/deepseek_v4.py"
MHC_PATH = "sglang/srt/layers/mhc.py"
MHC_MODULE = "sglang.srt.layers.mhc"

_LAYER_PRELUDE = '''
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

_is_hip = False
_MHC_POST_MULT_VALUE = 2.0


def compile_in_capture_mode(fn):  # eager: what SGLang runs outside CUDA-graph capture
    return fn


class _Flag:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class envs:  # the switches as server_args leaves them on sm_120
    SGLANG_OPT_USE_TILELANG_MHC_PRE = _Flag(False)
    SGLANG_OPT_DEEPGEMM_HC_PRENORM = _Flag(False)
    SGLANG_OPT_USE_AITER_MHC_PRE = _Flag(False)
    SGLANG_OPT_USE_AITER_MHC_POST = _Flag(False)
    SGLANG_OPT_USE_TILELANG_MHC_POST = _Flag({tilelang_post})
'''

# The gated-off fused path additionally reads DeepGEMM's switch (off on sm_120).
_FUSED_PRELUDE = _up.MHC_PRELUDE + '''

class _Flag:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class envs:  # sm_120: no DeepGEMM prenorm GEMM
    SGLANG_OPT_DEEPGEMM_HC_PRENORM = _Flag(False)
'''
_FUSED_DEFS = (
    "pass_configs", "FP8", "BF16", "FP32", "INT32", "mhc_pre_big_fuse_tilelang", "mhc_pre_gemm_sqrsum_tilelang",
    "_compute_num_split_for_mhc_pre", "mhc_pre_big_fuse_with_norm_tilelang", "mhc_post_tilelang",
    "mhc_fused_post_pre_fma_tilelang", "mhc_fused_post_pre",
)


def upstream_layer(tilelang_post: bool) -> type:
    """A class carrying upstream's `DeepseekV4DecoderLayer.hc_pre` / `hc_post`, verbatim from the wheel.

    Instances need `hc_mult`, `hc_sinkhorn_iters`, `hc_eps`, `rms_norm_eps` (see `make_layer`).
    The methods import `sglang.srt.layers.mhc` when called: wrap calls in `mhc_module(...)`.
    """
    text, origin = _up.source_of(MODEL_PATH)
    src = _LAYER_PRELUDE.format(tilelang_post=tilelang_post) + "\n\n" + _up.extract_methods(
        text, "DeepseekV4DecoderLayer", ("hc_pre", "hc_post"))
    mod = types.ModuleType(f"_v4flash_upstream_dsv4_layer_{int(tilelang_post)}")
    exec(compile(src, f"{origin} (DeepseekV4DecoderLayer.hc_pre, hc_post)", "exec"), mod.__dict__)
    return type("UpstreamLayer", (), {"hc_pre": mod.hc_pre, "hc_post": mod.hc_post, "origin": origin})


def make_layer(cls: type, p: R.MhcParams = R.MhcParams()) -> Any:
    layer = cls()
    layer.hc_mult = R.HC
    layer.hc_sinkhorn_iters = p.iters
    layer.hc_eps = p.pre_eps
    layer.rms_norm_eps = p.rms_eps
    return layer


def sinkhorn_standin(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int = 4,
                     sinkhorn_iters: int = 20, eps: float = 1e-6) -> Any:
    """`hc_split_sinkhorn`'s contract from the fp64 reference (TileLang cannot run on CPU); fp32 out."""
    b, s, _ = mixes.shape
    p = R.MhcParams(pre_eps=eps, sinkhorn_eps=eps, iters=sinkhorn_iters, post_mult=2.0)
    pre, post, comb = R.split_mixes(mixes.reshape(b * s, -1), hc_scale, hc_base, p)
    return (pre.float().view(b, s, hc_mult), post.float().view(b, s, hc_mult),
            comb.float().view(b, s, hc_mult, hc_mult))


@contextlib.contextmanager
def mhc_module(**functions: Callable[..., Any]) -> Iterator[None]:
    """Make `sglang.srt.layers.mhc` importable with these functions (unless a real one is loaded)."""
    if MHC_MODULE in sys.modules:
        yield
        return
    mod = types.ModuleType(MHC_MODULE)
    mod.__dict__.update(functions)
    sys.modules[MHC_MODULE] = mod
    try:
        yield
    finally:
        sys.modules.pop(MHC_MODULE, None)


def tilelang_available() -> bool:
    return importlib.util.find_spec("tilelang") is not None


def upstream_tilelang_fused() -> types.ModuleType:
    """Upstream's gated-off TileLang `mhc_fused_post_pre` and its kernels (`layers/mhc.py`), verbatim."""
    return _up.load_defs(MHC_PATH, _FUSED_DEFS, _FUSED_PRELUDE)


class UpstreamSm120:
    """The pinned sm_120 boundary: `hc_pre` (torch GEMV + RMS, Sinkhorn split, torch combine), `hc_post`.

    kind "compiled": TileLang Sinkhorn and post, the torch parts `torch.compile`d as SGLang runs them
    under CUDA-graph capture (`upstream.load_dsv4_mhc_methods`, the step bench's loader); "eager":
    the same, eager; "torch" (no tilelang, e.g. a CPU): the reference split stands in for the TileLang
    Sinkhorn and `hc_post` takes its own torch branch.
    """

    def __init__(self, p: R.MhcParams = R.MhcParams(), kind: str = "eager"):
        self.kind = kind
        if kind == "torch":
            self.functions = {"hc_split_sinkhorn": sinkhorn_standin}
            cls = upstream_layer(tilelang_post=False)
        else:
            tl = _up.load_mhc()
            self.functions = {"hc_split_sinkhorn": tl.hc_split_sinkhorn, "mhc_post": tl.mhc_post}
            if kind == "compiled":
                mod = _up.load_dsv4_mhc_methods()
                cls = type("UpstreamLayer", (), {"hc_pre": mod.hc_pre, "hc_post": mod.hc_post})
            else:
                cls = upstream_layer(tilelang_post=True)
        self.layer = make_layer(cls, p)

    def pre(self, x: Any, fn: Any, scale: Any, base: Any) -> Any:
        with mhc_module(**self.functions):
            return self.layer.hc_pre(x, fn, scale, base)

    def post(self, x: Any, residual: Any, post: Any, comb: Any) -> Any:
        with mhc_module(**self.functions):
            return self.layer.hc_post(x, residual, post, comb)
