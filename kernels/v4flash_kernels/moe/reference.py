"""fp64 reference of the MXFP4 routed-expert MLP, written from the format's definition, plus inputs.

MXFP4 (OCP microscaling): each weight is an e2m1 nibble (sign, 2 exponent bits, 1 mantissa bit:
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte with the even index in the low nibble (the
order SGLang's checkpoint loader and its sm_120 kernel use), and every 32 consecutive weights along
the reduction axis share one e8m0 scale 2^(byte - 127). The scales may be given as those bytes
(float8_e8m0fnu) or as fp32 values (what upstream's loader converts them to); as in upstream's
function, any other dtype is taken by value (`.to(float32)`), and fp32 values need not be powers
of two (the reference multiplies whatever it is given).

Semantics follow upstream's `mxfp4_moe_forward_triton`: w13 rows [0, I) are the gate projection,
[I, 2I) the up projection; with `clamp_limit > 0` the gate is clamped above and the up projection
both ways; `silu(gate) * up`; slots whose expert id is -1 contribute nothing; each slot is weighted
by its top-k weight and the token sum is multiplied by `routed_scaling_factor` when given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_values(dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> torch.Tensor:
    """The 16 nibble values, index = nibble (bit 3 = sign)."""
    mag = torch.tensor(E2M1, dtype=dtype, device=device)
    return torch.cat([mag, -mag])


def scale_values(scale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """float8_e8m0fnu bytes -> 2^(b-127) (255 = NaN); any other dtype is taken by value."""
    if scale.dtype == torch.float8_e8m0fnu:
        b = scale.view(torch.uint8).to(dtype)
        return torch.where(b == 255, torch.full_like(b, float("nan")), torch.pow(2.0, b - 127.0))
    return scale.to(dtype)


def dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[..., N, K/2] packed bytes + [..., N, K/32] scales -> [..., N, K] `dtype`."""
    b = packed.view(torch.uint8).to(torch.int64)
    lut = e2m1_values(dtype, packed.device)
    vals = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)  # even k = low nibble
    return vals * scale_values(scale, dtype).repeat_interleave(32, dim=-1)


def moe_ref(
    hidden_states: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    intermediate_size: int,
    routed_scaling_factor: float | None = None,
    clamp_limit: float | None = None,
    tokens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference output [len(tokens) or M, hidden] in `dtype` (only the rows `tokens` if given)."""
    I = int(intermediate_size)  # noqa: E741
    x = hidden_states.to(dtype)
    ids = topk_ids.to(torch.int64)
    tw = topk_weights.to(dtype)
    if tokens is not None:
        x, ids, tw = x[tokens], ids[tokens], tw[tokens]
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=dtype, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        t, k = torch.nonzero(ids == e, as_tuple=True)
        w13 = dequant(w13_packed[e], w13_scale[e], dtype)
        w2 = dequant(w2_packed[e], w2_scale[e], dtype)
        gu = x[t] @ w13.T
        gate, up = gu[:, :I], gu[:, I:]
        if clamp_limit is not None and clamp_limit > 0:
            gate = gate.clamp(max=clamp_limit)
            up = up.clamp(min=-clamp_limit, max=clamp_limit)
        h = torch.nn.functional.silu(gate) * up
        y = (h @ w2.T) * tw[t, k].unsqueeze(1)
        out.index_add_(0, t, y)
    if routed_scaling_factor is not None:
        out = out * routed_scaling_factor
    return out




# ---------------------------------------------------------------- random real-layout inputs


@dataclass(frozen=True)
class MoeCase:
    """One call's shapes and routing pattern."""

    tokens: int
    experts: int = 8
    topk: int = 6
    hidden: int = 128
    inter: int = 64
    routing: str = "random"  # random | hot (all tokens on expert 0 first) | dup (few experts shared)
    hole_frac: float = 0.0  # fraction of slots set to -1
    scale_e8m0: bool = False  # scales as e8m0 bytes (float8_e8m0fnu) instead of fp32
    clamp_limit: float | None = None
    routed_scaling_factor: float | None = None


def make_weights(experts: int, hidden: int, inter: int, scale_e8m0: bool, gen: torch.Generator,
                 device: str | torch.device = "cpu", copies: int = 1) -> List[Any]:
    """`copies` sets of (w13 int8 [E,2I,K/2], w2 int8 [E,K,I/2], s13, s2) with random nibbles and
    e8m0 exponents 2^-9..2^-5 (weights of magnitude ~0.01-0.1, like a real checkpoint's)."""
    res = []
    for _ in range(copies):
        w13 = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=torch.uint8, generator=gen)
        w2 = torch.randint(0, 256, (experts, hidden, inter // 2), dtype=torch.uint8, generator=gen)
        s13 = torch.randint(118, 123, (experts, 2 * inter, hidden // 32), dtype=torch.uint8, generator=gen)
        s2 = torch.randint(118, 123, (experts, hidden, inter // 32), dtype=torch.uint8, generator=gen)
        w13, w2, s13, s2 = (t.to(device) for t in (w13, w2, s13, s2))
        s13, s2 = s13.view(torch.float8_e8m0fnu), s2.view(torch.float8_e8m0fnu)
        if not scale_e8m0:  # what upstream's loader leaves: fp32 powers of two
            s13, s2 = s13.to(torch.float32), s2.to(torch.float32)
        res.append((w13.view(torch.int8), w2.view(torch.int8), s13, s2))
    return res


def make_routing(case: MoeCase, gen: torch.Generator, device: str | torch.device = "cpu") -> Any:
    """(topk_ids int32 [M, topk], topk_weights fp32 [M, topk]) for the case's pattern."""
    M, E, k = case.tokens, case.experts, case.topk
    if case.routing == "random":
        ids = torch.rand((M, E), generator=gen).topk(k, dim=1).indices
    elif case.routing == "hot":  # every token's first choice is expert 0
        rest = torch.rand((M, E - 1), generator=gen).topk(k - 1, dim=1).indices + 1
        ids = torch.cat([torch.zeros((M, 1), dtype=torch.int64), rest], dim=1)
    elif case.routing == "dup":  # all tokens on the same few experts
        base = torch.randperm(E, generator=gen)[:k]
        ids = base.unsqueeze(0).expand(M, k).clone()
        ids[1::2] = ids[1::2].flip(1)
    else:
        raise ValueError(case.routing)
    ids = ids.to(torch.int32)
    if case.hole_frac > 0:
        holes = torch.rand((M, k), generator=gen) < case.hole_frac
        ids = torch.where(holes, torch.full_like(ids, -1), ids)
    w = torch.softmax(torch.randn((M, k), generator=gen), dim=1).to(torch.float32)
    return ids.to(device), w.to(device)


def make_inputs(case: MoeCase, device: str | torch.device = "cpu", seed: int | None = None) -> Dict[str, Any]:
    """Keyword arguments of the upstream signature (and the reference), drawn fresh for `case`."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    w13, w2, s13, s2 = make_weights(case.experts, case.hidden, case.inter, case.scale_e8m0, g, device)[0]
    ids, w = make_routing(case, g, device)
    x = torch.randn((case.tokens, case.hidden), generator=g).to(torch.bfloat16).to(device)
    return {
        "hidden_states": x, "w13_packed": w13, "w2_packed": w2, "w13_scale": s13, "w2_scale": s2,
        "topk_ids": ids, "topk_weights": w, "hidden_size": case.hidden, "intermediate_size": case.inter,
        "routed_scaling_factor": case.routed_scaling_factor, "clamp_limit": case.clamp_limit,
    }


def ref_of(kw: Dict[str, Any], tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`moe_ref` on the keyword arguments of `make_inputs`."""
    return moe_ref(
        kw["hidden_states"], kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"],
        kw["topk_ids"], kw["topk_weights"], kw["intermediate_size"],
        kw.get("routed_scaling_factor"), kw.get("clamp_limit"), tokens=tokens,
    )


def touched_experts(topk_ids: torch.Tensor) -> int:
    return int(torch.unique(topk_ids[topk_ids >= 0]).numel())


def floor_bytes(kw: Dict[str, Any], experts_touched: int) -> int:
    """Bytes a call must move: touched experts' weights + scales as given, activations in and out."""
    per_expert = sum(kw[n][0].numel() * kw[n].element_size()
                     for n in ("w13_packed", "w2_packed", "w13_scale", "w2_scale"))
    x = kw["hidden_states"]
    return int(experts_touched * per_expert + 2 * x.numel() * x.element_size() + kw["topk_ids"].numel() * 8)


def flops(kw: Dict[str, Any]) -> float:
    """Useful FLOPs: 2 * valid slots * (K * 2I + I * K)."""
    valid = int((kw["topk_ids"] >= 0).sum())
    K = kw["hidden_states"].shape[1]
    I = kw["intermediate_size"]  # noqa: E741
    return float(2.0 * valid * (K * 2 * I + I * K))


def subset_tokens(M: int, limit: int, gen: torch.Generator, device: str | torch.device = "cpu") -> torch.Tensor | None:
    """Tokens checked against fp64 for big M (None = all)."""
    if M <= limit:
        return None
    return torch.randperm(M, generator=gen)[:limit].sort().values.to(device)

