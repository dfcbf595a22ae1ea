"""mHC rows of the step: upstream's sm_120 hc_pre / hc_post (torch + TileLang) vs ours, and our fused
boundary, checked vs the fp64 hyper-connection definition."""

from __future__ import annotations

from typing import Any, Tuple

import torch

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import common as C
from v4flash_bench.step.ops.common import Check, Prepared, Unavailable
from v4flash_kernels import upstream as _up
from v4flash_kernels.kit.compare import rel_err


def upstream_mhc() -> Any:
    """The pinned `DeepseekV4DecoderLayer.hc_pre` / `hc_post` (their TileLang kernels included) as
    functions of a stand-in layer, compiled once at one token so that a machine without a working
    TileLang says so once (`Unavailable`, the op falls back to its labelled estimate)."""
    if "mhc" in C.loaded:
        got = C.loaded["mhc"]
        if isinstance(got, Unavailable):
            raise got
        return got
    try:
        mod = _up.load_dsv4_mhc_methods()
        layer = mhc_layer()
        x = torch.randn((1, M.HC_MULT, M.HIDDEN), device=C.DEVICE).to(torch.bfloat16)
        fn, scale, base = mhc_params(torch.Generator(device=C.DEVICE).manual_seed(0))
        _y, post, comb, _ = mod.hc_pre(layer, x, fn, scale, base)
        # a fresh [1, hidden] tensor: x[:, 0].contiguous() keeps stride 16384 on its size-1 dim, which
        # PyTorch calls contiguous and TileLang's stride check refuses
        sub = torch.randn((1, M.HIDDEN), device=C.DEVICE).to(torch.bfloat16)
        mod.hc_post(layer, sub, x, post, comb)
        C.sync()
    except Exception as exc:
        err = Unavailable(f"TileLang mHC unavailable here: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        C.loaded["mhc"] = err
        raise err from exc
    C.loaded["mhc"] = mod
    return mod


def mhc_layer() -> Any:
    """The attributes `hc_pre`/`hc_post` read from the layer (DeepSeek-V4-Flash config)."""
    from types import SimpleNamespace

    return SimpleNamespace(hc_mult=M.HC_MULT, hc_sinkhorn_iters=M.HC_SINKHORN_ITERS, hc_eps=M.HC_EPS,
                           rms_norm_eps=M.RMS_EPS)


def mhc_params(gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 hc_fn [24, 4*4096] scaled so the mixing logits are O(1), hc_scale [3], hc_base [24]."""
    k = M.HC_MULT * M.HIDDEN
    fn = torch.randn((M.HC_MIX, k), generator=gen, device=C.DEVICE) * k ** -0.5
    scale = torch.rand((3,), generator=gen, device=C.DEVICE) * 0.5 + 0.75
    base = torch.randn((M.HC_MIX,), generator=gen, device=C.DEVICE) * 0.5
    return fn, scale, base


def mhc_pre_ref(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> Any:
    """fp64 hyper-connection pre from its definition: RMS-normalised mix logits of the flattened
    residual, pre = sigmoid + eps, post = 2 sigmoid, comb = row-softmax + eps then 20 alternating
    column/row normalisations (each divisor + eps), y = sum_j pre_j x_j."""
    n, hc, _ = x.shape
    xf = x.double().reshape(n, -1)
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + M.RMS_EPS)
    mix = (xf @ fn.double().t()) * rs
    sc, bs, eps = scale.double(), base.double(), M.HC_EPS
    pre = torch.sigmoid(mix[:, :hc] * sc[0] + bs[:hc]) + eps
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * sc[1] + bs[hc:2 * hc])
    comb = (mix[:, 2 * hc:] * sc[2] + bs[2 * hc:]).view(n, hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(1, keepdim=True) + eps)
    for _ in range(M.HC_SINKHORN_ITERS - 1):
        comb = comb / (comb.sum(2, keepdim=True) + eps)
        comb = comb / (comb.sum(1, keepdim=True) + eps)
    y = (pre.unsqueeze(-1) * x.double()).sum(1)
    return y, post, comb


def mhc_post_ref(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_residual[j] = post_j x + sum_k comb[k, j] residual[k] (fp64)."""
    return post.double().unsqueeze(-1) * x.double().unsqueeze(1) + torch.einsum(
        "nkj,nkh->njh", comb.double(), residual.double())


def mhc_rmsnorm_ref(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp64 RMSNorm of y as the sub-layer reads it (bf16), weight bf16."""
    yb = y.to(torch.bfloat16).double()
    return yb * torch.rsqrt(yb.square().mean(-1, keepdim=True) + M.RMS_EPS) * w.double()


def build_mhc_fused(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """Ours only (upstream's fused kernel is gated off on sm_120): the post of one sub-layer, the pre of
    the next and its RMSNorm, one call; checked against the fp64 post and the fp64 pre + RMSNorm of the
    streams it wrote (what the unfused pair computes)."""
    if impl != "ours":
        raise Unavailable("upstream runs no fused mHC boundary on sm_120 (its TileLang one is gated off)")
    fn_impl, why = C.patch_function("mhc_fused")
    if fn_impl is None:
        raise Unavailable(why)
    rows = C.int_param(op.p, "rows")
    g = C.gen(seed)
    x = C.randn((rows, M.HC_MULT, M.HIDDEN), g)
    r = C.rotations(M.HC_MIX * M.HC_MULT * M.HIDDEN * 4, l2)
    params = [mhc_params(g) for _ in range(r)]
    fn0, scale0, base0 = params[0]
    _y, post_ref, comb_ref = mhc_pre_ref(x, fn0, scale0, base0)
    post_in, comb_in = post_ref.float(), comb_ref.float()
    sub = C.randn((rows, M.HIDDEN), g)
    w = (1.0 + 0.1 * torch.randn((M.HIDDEN,), generator=g, device=C.DEVICE)).to(torch.bfloat16)
    consts = (M.RMS_EPS, M.HC_EPS, M.HC_EPS, 2.0, M.HC_SINKHORN_ITERS)

    def call(fn: Any, scale: Any, base: Any) -> Any:  # post as the model passes it, [rows, 4, 1]
        return fn_impl(sub, x, post_in.unsqueeze(-1), comb_in, fn, scale, base, *consts, norm_weight=w,
                       norm_eps=M.RMS_EPS)

    def run() -> None:
        for fn, scale, base in params:
            call(fn, scale, base)

    def one(i: int) -> None:
        call(*params[i % len(params)])

    def check() -> Check:
        cur, post, comb, y = call(fn0, scale0, base0)
        C.sync()
        rcur = mhc_post_ref(sub, x, post_in, comb_in)
        ry, rp, rc = mhc_pre_ref(cur, fn0, scale0, base0)
        errs = (rel_err(cur, rcur), rel_err(y, mhc_rmsnorm_ref(ry, w)), rel_err(post.reshape(rp.shape), rp),
                rel_err(comb.reshape(rc.shape), rc))
        return C.check_of(max(errs), "streams {:.1e}, y {:.1e}, post {:.1e}, comb {:.1e}".format(*errs))

    return Prepared(run, r, check, why, one)


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    kind, rows = str(op.p["kind"]), C.int_param(op.p, "rows")
    if kind == "fused":
        return build_mhc_fused(op, impl, l2, seed)
    hook = "mhc_pre" if kind == "pre" else "mhc_post"
    if impl == "upstream":
        mod = upstream_mhc()
        fn_impl = mod.hc_pre if kind == "pre" else mod.hc_post
        src = ("upstream hc_pre: torch.compile'd norm + fp32 mix GEMV, TileLang hc_split_sinkhorn, torch combine"
               if kind == "pre" else "upstream hc_post: TileLang mhc_post")
    else:
        fn_impl, why = C.patch_function(hook)
        if fn_impl is None:
            raise Unavailable(why)
        src = why
    layer = mhc_layer()
    g = C.gen(seed)
    x = C.randn((rows, M.HC_MULT, M.HIDDEN), g)
    r = C.rotations(M.HC_MIX * M.HC_MULT * M.HIDDEN * 4, l2) if kind == "pre" else 1
    params = [mhc_params(g) for _ in range(r)]
    fn0, scale0, base0 = params[0]
    _y, post_ref, comb_ref = mhc_pre_ref(x, fn0, scale0, base0)
    post_in, comb_in = post_ref.float(), comb_ref.float()
    sub = C.randn((rows, M.HIDDEN), g)

    one = None
    if kind == "pre":
        def run() -> None:
            for fn, scale, base in params:
                fn_impl(layer, x, fn, scale, base)

        def one(i: int) -> None:
            fn_impl(layer, x, *params[i % len(params)])

        def check() -> Check:
            y, post, comb, _ = fn_impl(layer, x, fn0, scale0, base0)
            C.sync()
            ry, rp, rc = mhc_pre_ref(x, fn0, scale0, base0)
            errs = (rel_err(y, ry), rel_err(post.reshape(rp.shape), rp), rel_err(comb.reshape(rc.shape), rc))
            return C.check_of(max(errs), "y {:.1e}, post {:.1e}, comb {:.1e}".format(*errs))
    else:
        def run() -> None:
            fn_impl(layer, sub, x, post_in, comb_in)

        def check() -> Check:
            out = fn_impl(layer, sub, x, post_in, comb_in)
            C.sync()
            return C.check_of(rel_err(out, mhc_post_ref(sub, x, post_in, comb_in)))

    return Prepared(run, r, check, src, one)
