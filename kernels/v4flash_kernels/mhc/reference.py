"""fp64 reference of DeepSeek-V4's manifold-constrained hyper-connections (mHC), plus random inputs.

The model keeps `hc = 4` residual streams per token (`residual`: `[N, 4, H]` bf16). Around each
sub-layer (attention, MoE) it runs a *pre* that mixes the streams into the sub-layer's input and
a *post* that folds the sub-layer's output back into the streams:

pre, for one token with streams `x_j` (j < 4) flattened to `x` of length `4H`:

    rs      = 1 / sqrt(mean(x^2) + rms_eps)
    m       = (hc_fn @ x) * rs                          hc_fn: [24, 4H] fp32 -> 24 mixes
    pre_j   = sigmoid(m[j]     * scale[0] + base[j])     + pre_eps
    post_j  = sigmoid(m[4+j]   * scale[1] + base[4+j])   * post_mult        (post_mult = 2)
    c[j,k]  =         m[8+4j+k] * scale[2] + base[8+4j+k]
    c       = softmax over k of c, + sinkhorn_eps; then c[j,k] /= (sum_j c[j,k] + sinkhorn_eps)
    repeat (iters - 1) times: c[j,k] /= (sum_k c[j,k] + eps); c[j,k] /= (sum_j c[j,k] + eps)
    y       = sum_j pre_j * x_j                          -> the sub-layer input (bf16)
    comb    = c                                          -> kept for the post

post, with the sub-layer output `o` (`[H]` bf16) and the same token's `post`, `comb`:

    new_j   = post_j * o + sum_k comb[k, j] * x_k        -> the next streams (bf16)

The sub-layer's RMSNorm reads `y` as bf16: `rmsnorm(y) = y * rsqrt(mean(y^2) + norm_eps) * w`
with the weight taken as bf16. A fused post+pre reads the post's bf16 streams. Those two bf16
roundings are part of the model's data flow, so the reference applies them where the model does
and nowhere else.

Which bf16 streams the pre of a fused boundary must be checked on: the ones the op *wrote*
(`pre_of_streams`), not the fp64 post rounded (`post_pre_ref`'s `residual_bf16`). Every fp32 post
(ours, upstream's TileLang and torch ones) lands a few elements per token on the other side of a
bf16 rounding tie from the fp64 value; each such element moves one mix by up to ~1e-4 through the
16K-term GEMV, so the pre of the fp64-rounded streams is not what any unfused pair computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

HC = 4
MIX = (2 + HC) * HC  # 24
RMS_EPS = 1e-6  # DeepSeek-V4 config: rms_norm_eps, hc_eps, hc_sinkhorn_iters
HC_EPS = 1e-6
SINKHORN_ITERS = 20
POST_MULT = 2.0


@dataclass(frozen=True)
class MhcParams:
    """The scalar parameters of one boundary (defaults: DeepSeek-V4-Flash's config)."""

    rms_eps: float = RMS_EPS
    pre_eps: float = HC_EPS
    sinkhorn_eps: float = HC_EPS
    iters: int = SINKHORN_ITERS
    post_mult: float = POST_MULT
    norm_eps: float = RMS_EPS


@dataclass(frozen=True)
class MhcCase:
    """A test/bench shape: `tokens` tokens of `hidden` per stream; which inputs to draw."""

    tokens: int
    hidden: int = 4096
    norm: bool = True
    params: MhcParams = MhcParams()


def split_mixes(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, p: MhcParams) -> Tuple[torch.Tensor, ...]:
    """`[N, 24]` mixes -> (pre `[N, 4]`, post `[N, 4]`, comb `[N, 4, 4]`), in fp64."""
    m = mixes.double()
    s = scale.double()
    b = base.double()
    pre = torch.sigmoid(m[:, :HC] * s[0] + b[:HC]) + p.pre_eps
    post = torch.sigmoid(m[:, HC:2 * HC] * s[1] + b[HC:2 * HC]) * p.post_mult
    c = (m[:, 2 * HC:] * s[2] + b[2 * HC:]).view(-1, HC, HC)
    c = torch.softmax(c, dim=-1) + p.sinkhorn_eps
    c = c / (c.sum(dim=-2, keepdim=True) + p.sinkhorn_eps)
    for _ in range(p.iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + p.sinkhorn_eps)
        c = c / (c.sum(dim=-2, keepdim=True) + p.sinkhorn_eps)
    return pre, post, c


def mixes_ref(x: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """`[N, 24]` fp64: the 24 projections of the flattened streams, scaled by their inverse RMS."""
    xf = x.double().reshape(x.shape[0], -1)
    rs = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + rms_eps)
    return (xf @ fn.double().t()) * rs


def pre_ref(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, p: MhcParams) -> Dict[str, Any]:
    """The pre of `x` `[N, 4, H]`: y `[N, H]` (before any rounding), post, comb, mixes; all fp64."""
    mixes = mixes_ref(x, fn, p.rms_eps)
    pre, post, comb = split_mixes(mixes, scale, base, p)
    y = (pre.unsqueeze(-1) * x.double()).sum(dim=1)
    return {"y": y, "post": post, "comb": comb, "mixes": mixes}


def layer_input_ref(y: torch.Tensor, norm_weight: torch.Tensor | None, norm_eps: float) -> torch.Tensor:
    """What the sub-layer receives: y as bf16, then (if a norm weight is given) its RMSNorm; fp64."""
    yb = y.to(torch.bfloat16).double()
    if norm_weight is None:
        return yb
    w = norm_weight.to(torch.bfloat16).double()
    return yb * torch.rsqrt(yb.square().mean(dim=-1, keepdim=True) + norm_eps) * w


def post_ref(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`[N, 4, H]` fp64 next streams: post_j * x + sum_k comb[k, j] * residual_k."""
    post = post.double().reshape(residual.shape[0], HC)
    return post.unsqueeze(-1) * x.double().unsqueeze(1) + torch.einsum("nkj,nkh->njh", comb.double(),
                                                                        residual.double())


def post_pre_ref(inputs: Dict[str, Any], p: MhcParams) -> Dict[str, Any]:
    """The fused boundary: the post's streams (fp64, and as the bf16 the model stores), then the pre."""
    r = post_ref(inputs["x"], inputs["residual"], inputs["post"], inputs["comb"])
    rb = r.to(torch.bfloat16)
    out = pre_ref(rb, inputs["hc_fn"], inputs["hc_scale"], inputs["hc_base"], p)
    out["residual"] = r
    out["residual_bf16"] = rb
    out["layer_input"] = layer_input_ref(out["y"], inputs.get("norm_weight"), p.norm_eps)
    return out


def pre_of_streams(streams: torch.Tensor, inputs: Dict[str, Any], p: MhcParams) -> Dict[str, Any]:
    """The pre (fp64) and the sub-layer input of given bf16 streams `[N, 4, H]`: what the unfused
    pair's pre computes on whatever streams its post wrote."""
    out = pre_ref(streams, inputs["hc_fn"], inputs["hc_scale"], inputs["hc_base"], p)
    out["layer_input"] = layer_input_ref(out["y"], inputs.get("norm_weight"), p.norm_eps)
    return out


def make_inputs(case: MhcCase, device: str = "cpu", seed: int = 0) -> Dict[str, Any]:
    """Random inputs of one boundary with model-like magnitudes.

    The streams have unequal scales (as a trained residual does); `hc_fn` is sized so the mixes
    are O(1) after the RMS scaling, which puts the sigmoids and the Sinkhorn softmax in their
    sensitive range; `post`/`comb` (the previous pre's outputs) come from the reference split.
    """
    g = torch.Generator().manual_seed(seed)
    n, h = case.tokens, case.hidden
    stream_scale = torch.tensor([1.0, 0.5, 2.0, 0.25]).view(1, HC, 1)
    residual = (torch.randn(n, HC, h, generator=g) * stream_scale).to(torch.bfloat16)
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    hc_fn = torch.randn(MIX, HC * h, generator=g) * (2.0 / (HC * h) ** 0.5)
    hc_scale = torch.rand(3, generator=g) * 1.5 + 0.5
    hc_base = torch.randn(MIX, generator=g)
    prev = torch.randn(n, MIX, generator=g) * 2.0
    pre, post, comb = split_mixes(prev, hc_scale, hc_base, case.params)
    del pre
    out = {
        "x": x,
        "residual": residual,
        "post": post.float(),
        "comb": comb.float(),
        "hc_fn": hc_fn.float(),
        "hc_scale": hc_scale.float(),
        "hc_base": hc_base.float(),
        "norm_weight": (1.0 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16) if case.norm else None,
    }
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 for empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    den = ref.double().abs().max().item()
    return (out.double() - ref.double()).abs().max().item() / max(den, 1e-300)


def max_abs(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return (out.double() - ref.double()).abs().max().item()
