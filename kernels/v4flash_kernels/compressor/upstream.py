"""Upstream's own Triton statement of the compressor step, loaded from the pinned wheel at run time: the
baseline the self-check, the bench and the tests hold ours against.

sglang 0.5.13.post1's CUDA path is JIT CUDA (`c4_v2.cuh`, `c128_v2.cuh`, `fused_norm_rope_v2.cuh`), which
needs SGLang's CUDA JIT. The same wheel states the same math in Triton for HIP: `fused_compress_triton.py`
(`hip_compress_forward`: the ring update and the window pooling; `hip_compress_fused_norm_rope_inplace` /
`..._hadamard_inplace`: RMSNorm + RoPE (+ Hadamard)) on the same state layout, and the non-fused store
path (`quant_to_nope_fp8_rope_bf16_pack_triton` + the FlashMLA `_set_k_and_s_triton`; `act_quant` +
the indexer's `_set_k_and_s_triton`) writes the same cache formats. With `linear_bf16_fp32`'s torch GEMM
in front, that is upstream's compressor step in upstream's code.

Its wrappers take the v1 metadata: the decode plan's pages become `indices` (this window's page) and
`extra_data` (the previous window's page). They assert CUDA tensors; under the CPU interpreter the
kernels are launched with the wrappers' own arguments instead (`_hip_compress_cpu`, `_hip_norm_rope_cpu`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, Tuple, cast

import torch

from v4flash_kernels import upstream as _up

FUSED_PATH = "sglang/srt/layers/attention/dsv4/fused_compress_triton.py"
COMPRESS_OLD_PATH = "sglang/jit_kernel/dsv4/compress_old.py"
QUANT_PATH = "sglang/srt/layers/attention/dsv4/quant_k_cache.py"
MLA_ACCESSOR_PATH = "sglang/srt/layers/attention/dsv4/index_buf_accessor.py"
DSA_KERNEL_PATH = "sglang/srt/layers/attention/dsa/triton_kernel.py"
DSA_ACCESSOR_PATH = "sglang/srt/layers/attention/dsa/index_buf_accessor.py"

_FUSED_DEFS = ("_c4_decode_kernel", "_c128_decode_kernel", "_compress_norm_rope_kernel",
               "_compress_norm_rope_hadamard_kernel", "_plan_as_i32", "_block_d", "_check_common", "_is_decode_plan",
               "hip_compress_forward", "hip_compress_fused_norm_rope_inplace",
               "hip_compress_fused_norm_rope_hadamard_inplace")
_loaded: Dict[str, ModuleType] = {}


def plans() -> ModuleType:
    """compress_old's `CompressorDecodePlan` / `CompressorPrefillPlan` (the v1 plan types), verbatim."""
    if "plans" not in _loaded:
        _loaded["plans"] = _up.load_defs(COMPRESS_OLD_PATH, ("CompressorPrefillPlan", "CompressorDecodePlan"),
                                         "from __future__ import annotations\n\n"
                                         "from typing import Literal, NamedTuple, Optional, Union\n\nimport torch\n")
    return _loaded["plans"]


def hip() -> ModuleType:
    """`fused_compress_triton.py`'s decode kernels and wrappers, verbatim."""
    if "hip" not in _loaded:
        p = plans()
        import sys

        sys.modules.setdefault(p.__name__, p)
        prelude = ("from __future__ import annotations\n\nfrom typing import Optional, Union\n\n"
                   "import torch\nimport triton\nimport triton.language as tl\n\n"
                   f"from {p.__name__} import CompressorDecodePlan, CompressorPrefillPlan\n")
        _loaded["hip"] = _up.load_defs(FUSED_PATH, _FUSED_DEFS, prelude)
    return _loaded["hip"]


_HEAD = "from __future__ import annotations\n\nfrom typing import Any, Optional, Tuple\n\n"
_TRITON = "import torch\nimport triton\nimport triton.language as tl\n\n"


def store() -> Tuple[ModuleType, ModuleType]:
    """(FlashMLA quant + store, indexer quant + store): upstream's non-fused Triton store path, verbatim
    (its CUDA branches: e4m3fn, no HIP preshuffle)."""
    if "mla" not in _loaded:
        import sys

        acc = _up.load_defs(MLA_ACCESSOR_PATH, ("NopeFp8RopeBf16Pack", "_set_k_and_s_triton",
                                                "_set_k_and_s_triton_kernel"),
                            _HEAD + "from dataclasses import dataclass\n\n" + _TRITON + "fp8_dtype = torch.float8_e4m3fn\n")
        sys.modules.setdefault(acc.__name__, acc)
        _loaded["mla_acc"] = acc
        _loaded["mla"] = _up.load_defs(QUANT_PATH, ("_quant_k_cache_fused_kernel",
                                                    "quant_to_nope_fp8_rope_bf16_pack_triton"),
                                       _HEAD + _TRITON + f"from {acc.__name__} import NopeFp8RopeBf16Pack\n\n"
                                       "fp8_dtype = torch.float8_e4m3fn\n")
        _loaded["idx"] = _up.load_defs(DSA_KERNEL_PATH, ("_act_quant_kernel", "act_quant"), _HEAD + _TRITON)
        _loaded["idx_acc"] = _up.load_defs(DSA_ACCESSOR_PATH, ("_set_k_and_s_triton", "_set_k_and_s_triton_kernel"),
                                           _HEAD + _TRITON + "_is_hip = False\n_use_aiter_preshuffle = False\n"
                                           "_is_fp8_fnuz = False\n")
    return _loaded["mla"], _loaded["idx"]


# ----------------------------------------------------------------------------- one step, upstream's way


def kv_score(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear_bf16_fp32` (its cuBLAS algorithm: `torch.mm(out_dtype=fp32)`); on the CPU, where torch has no
    such kernel, the same product of the exact bf16 values in fp32."""
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return x.float() @ weight.float().t()


def _v1_meta(plan_d: torch.Tensor, ratio: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The v1 decode metadata of a v2 decode plan: this window's page, the previous one, the lengths."""
    i32 = plan_d.view(torch.int32) if plan_d.dtype == torch.uint8 else plan_d
    seq = i32[:, 0].contiguous()
    return i32[:, 3].contiguous(), (i32[:, 2].contiguous().view(-1, 1) if ratio == 4 else i32[:, 2].contiguous()), seq


def compress(state: torch.Tensor, kvs: torch.Tensor, ape: torch.Tensor, plan_d: torch.Tensor, ratio: int,
             head_dim: int) -> torch.Tensor:
    """`hip_compress_forward` on a decode step: updates `state` in place, returns the pooled rows [T, hd]
    (rows that complete no window hold whatever the kernel computed for them, as upstream's)."""
    h = hip()
    indices, extra, seq = _v1_meta(plan_d, ratio)
    coff = 2 if ratio == 4 else 1
    buf = state.view(-1, ratio, 2 * coff * head_dim)
    ape2 = ape.view(-1, head_dim)
    plan = plans().CompressorDecodePlan(ratio, seq)
    if kvs.is_cuda:
        return cast(torch.Tensor, h.hip_compress_forward(kv_score_buffer=buf, kv_score_input=kvs, ape=ape2,
                                                         indices=indices, plan=plan, extra_data=extra,
                                                         head_dim=head_dim, compress_ratio=ratio))
    out = kvs.new_empty((kvs.shape[0], head_dim))
    block_d = h._block_d(head_dim)
    grid = (seq.numel(), -(-head_dim // block_d))
    kern = h._c4_decode_kernel if ratio == 4 else h._c128_decode_kernel
    extra_kw = {} if ratio == 4 else {"BLOCK_S": 64}
    kern[grid](kvs, out, buf, ape2, indices, seq, extra, kvs.stride(0), out.stride(0), buf.stride(0), buf.stride(1),
               ape2.stride(0), HEAD_DIM=head_dim, BLOCK_D=block_d, **extra_kw)
    return out


def norm_rope(kv: torch.Tensor, weight: torch.Tensor, eps: float, freqs_cis: torch.Tensor, plan_d: torch.Tensor,
              ratio: int, rotate: bool) -> None:
    """`hip_compress_fused_norm_rope_inplace` (or `..._hadamard_inplace`) on a decode step, in place."""
    h = hip()
    _, _, seq = _v1_meta(plan_d, ratio)
    plan = plans().CompressorDecodePlan(ratio, seq)
    hd = kv.shape[1]
    if kv.is_cuda:
        if rotate:
            h.hip_compress_fused_norm_rope_hadamard_inplace(kv, weight, eps, freqs_cis, plan, hd)
        else:
            h.hip_compress_fused_norm_rope_inplace(kv, weight, eps, freqs_cis, plan)
        return
    import triton

    freqs = torch.view_as_real(freqs_cis).flatten(-2)
    common = {"HEAD_DIM": hd, "ROPE_DIM": freqs.shape[-1], "HEAD_BLOCK": triton.next_power_of_2(hd),
              "ROPE_PAIR_BLOCK": triton.next_power_of_2(freqs.shape[-1] // 2), "COMPRESS_RATIO": ratio,
              "IS_DECODE": True}
    if rotate:
        h._compress_norm_rope_hadamard_kernel[(seq.numel(),)](kv, weight, freqs, seq, eps, hd ** -0.5, kv.stride(0),
                                                               freqs.stride(0), 0, LOG2_HEAD_DIM=hd.bit_length() - 1,
                                                               **common)
    else:
        h._compress_norm_rope_kernel[(seq.numel(),)](kv, weight, freqs, seq, eps, kv.stride(0), freqs.stride(0), 0,
                                                     **common)


def store_rows(y: torch.Tensor, out_loc: torch.Tensor, cache: torch.Tensor, page_size: int, indexer: bool) -> None:
    """Upstream's non-fused store of the rows `y` [n, hd] at `out_loc` [n] (GPU: its Triton fp8 casts)."""
    mla, idx = store()
    if y.shape[0] == 0:
        return
    if indexer:
        q, s = idx.act_quant(y.contiguous())
        _loaded["idx_acc"]._set_k_and_s_triton(cache, out_loc.to(torch.int64), q, s, page_size)
    else:
        pack = mla.quant_to_nope_fp8_rope_bf16_pack_triton(y.bfloat16())
        _loaded["mla_acc"]._set_k_and_s_triton(cache, out_loc, pack, page_size)


def step(case: Dict[str, Any], with_store: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Upstream's step on `case` (the tensors of `reference.make_case`), in place on its state (and cache
    when `with_store`): returns (kv_score [T, N] fp32, y [T, hd] fp32: the rows after norm + RoPE
    (+ Hadamard), meaningful where a window completed)."""
    ratio, hd = int(case["ratio"]), int(case["head_dim"])
    plan_d = case["plan_d"]
    kvs = kv_score(case["x"], case["weight"])
    y = compress(case["state"], kvs, case["ape"], plan_d, ratio, hd)
    norm_rope(y, case["norm_weight"], float(case["eps"]), case["freqs_cis"], plan_d, ratio,
              rotate=hd == 128)
    if with_store:
        i32 = plan_d.view(torch.int32) if plan_d.dtype == torch.uint8 else plan_d
        seq = i32[:, 0]
        done = ((seq > 0) & (seq % ratio == 0)).nonzero().flatten()
        store_rows(y[done], case["out_loc"][done].contiguous(), case["cache"], int(case["page_size"]),
                   indexer=hd == 128)
    return kvs, y
