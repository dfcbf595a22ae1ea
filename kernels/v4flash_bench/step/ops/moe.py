"""Routed MXFP4 MoE rows of the step: upstream's Triton forward vs ours (experts repacked at load time,
as the moe switch serves), checked vs the fp64 experts on a few rows."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import common as C
from v4flash_bench.step.ops.common import Check, Prepared, Unavailable
from v4flash_kernels import upstream as _up
from v4flash_kernels.kit.compare import rel_err

MOE_PATH = "sglang/srt/layers/moe/fused_moe_triton/mxfp4_moe_sm120_triton.py"

# DeepSeek-V4-Flash's MoE epilogue as the pinned `apply` passes it (runner config).
ROUTED_SCALING = 1.5
SWIGLU_LIMIT = 10.0


def upstream_moe() -> Any:
    if "moe" not in C.loaded:
        C.loaded["moe"] = _up.load_module(MOE_PATH)
    return C.loaded["moe"]


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N, K/2] e2m1 nibbles (low nibble = even k) x [N, K/32] scales -> [N, K] fp64."""
    lut = torch.tensor(E2M1, dtype=torch.float64, device=packed.device)
    b = packed.view(torch.uint8).long()
    vals = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)
    return vals * scale.double().repeat_interleave(M.MXFP4_GROUP, dim=-1)


def moe_ref(x: Any, w13: Any, w2: Any, s13: Any, s2: Any, ids: Any, weights: Any, rows: List[int]) -> torch.Tensor:
    inter = w2.shape[-1] * 2
    out = torch.zeros((len(rows), x.shape[1]), dtype=torch.float64, device=x.device)
    for i, r in enumerate(rows):
        xr = x[r].double()
        for j in range(ids.shape[1]):
            e = int(ids[r, j])
            if e < 0:
                continue
            h = mxfp4_dequant(w13[e], s13[e]) @ xr
            gate, up = h[:inter].clamp(max=SWIGLU_LIMIT), h[inter:].clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
            act = F.silu(gate) * up
            out[i] += float(weights[r, j]) * (mxfp4_dequant(w2[e], s2[e]) @ act)
    return out * ROUTED_SCALING


def moe_weights(seed: int, tp: int = M.TP) -> Any:
    """All 256 experts of one layer at `tp` in the pinned load path's layout: int8 nibbles, fp32 scales."""
    g = C.gen(seed)
    inter = M.MOE_INTER // tp
    E, K = M.N_EXPERTS, M.HIDDEN
    w13 = torch.randint(-128, 128, (E, 2 * inter, K // 2), generator=g, device=C.DEVICE, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (E, K, inter // 2), generator=g, device=C.DEVICE, dtype=torch.int8)
    s13 = torch.pow(2.0, torch.randint(-9, -6, (E, 2 * inter, K // 32), generator=g, device=C.DEVICE).float())
    s2 = torch.pow(2.0, torch.randint(-8, -5, (E, K, inter // 32), generator=g, device=C.DEVICE).float())
    return w13, w2, s13, s2


_moe_w: Dict[Any, Any] = {}  # tp -> loader-layout experts; ("repacked", tp) -> their v2 form


def _moe_repacked(tp: int) -> Any:
    """This TP's bench experts in the load-time repacked layout (None when the repack is absent)."""
    if importlib.util.find_spec("v4flash_kernels.moe.repack") is None:
        return None
    key = ("repacked", tp)
    if key not in _moe_w:
        from v4flash_kernels.moe.repack import repack_experts

        w13, w2, s13, s2 = _moe_w[tp]
        _moe_w[key] = repack_experts(w13, w2, s13, s2)
    return _moe_w[key]


def _moe_v2_call(forward: Any, experts: Any, *, hidden_states: Any, topk_ids: Any, topk_weights: Any,
                 routed_scaling_factor: Any, clamp_limit: Any,
                 **_upstream_only: Any) -> Any:
    return forward(hidden_states, experts, topk_ids, topk_weights, routed_scaling_factor, clamp_limit)


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    m, tp = C.int_param(op.p, "m"), C.int_param(op.p, "tp", M.TP)
    if tp not in _moe_w:  # one expert set per TP reused by every MoE shape (806 MB + scales at TP4, far past L2)
        _moe_w.clear()  # the run orders shapes by TP, so one set is resident at a time
        _moe_w[tp] = moe_weights(seed, tp)
    w13, w2, s13, s2 = _moe_w[tp]
    g = C.gen(seed + 1)
    r = 8 if m == 1 else (2 if m <= 16 else 1)  # routing sets per replay, so B=1 does not hit L2
    x = C.randn((m, M.HIDDEN), g)
    routes = []
    for _ in range(r):
        ids = torch.rand((m, M.N_EXPERTS), generator=g, device=C.DEVICE).topk(M.TOPK_EXPERTS, dim=1).indices
        wts = torch.rand((m, M.TOPK_EXPERTS), generator=g, device=C.DEVICE)
        routes.append((ids.to(torch.int32), wts / wts.sum(1, keepdim=True)))
    if impl == "upstream":
        fn = upstream_moe().mxfp4_moe_forward_triton
        src = "upstream mxfp4_moe_forward_triton (wheel)"
    else:
        fn, why = C.patch_function("moe")
        if fn is None:
            raise Unavailable(why)
        src = why
        repacked = _moe_repacked(tp)
        if repacked is not None:  # what the moe switch serves: experts repacked at load time, decode v2
            from v4flash_kernels.moe.repacked_op import moe_forward_repacked

            fn = functools.partial(_moe_v2_call, moe_forward_repacked, repacked)
            src = "ours: v4flash_kernels.moe.repacked_op.moe_forward_repacked on experts repacked at load time"

    def one(ids: Any, wts: Any) -> Any:
        return fn(hidden_states=x, w13_packed=w13, w2_packed=w2, w13_scale=s13, w2_scale=s2, topk_ids=ids,
                  topk_weights=wts, hidden_size=M.HIDDEN, intermediate_size=M.MOE_INTER // tp,
                  routed_scaling_factor=ROUTED_SCALING, clamp_limit=SWIGLU_LIMIT)

    def run() -> None:
        for ids, wts in routes:
            one(ids, wts)

    def one_call(i: int) -> None:
        one(*routes[i % len(routes)])

    def check() -> Check:
        ids, wts = routes[0]
        out = one(ids, wts)
        C.sync()
        rows = sorted({0, 1, 2, m // 2, m - 1} & set(range(m)))
        ref = moe_ref(x, w13, w2, s13, s2, ids, wts, rows)
        return C.check_of(rel_err(out[rows], ref), f"rows {rows}")

    return Prepared(run, r, check, src, one_call)
