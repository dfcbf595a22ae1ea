"""Self-check cases of the mHC patch (`mhc`): see v4flash_kernels.selfcheck.

With the switch on, the model runs every sub-layer boundary through the fused op (`mhc_fused_post_pre`:
the previous sub-layer's post, the next pre and that sub-layer's RMSNorm), its first pre through
`hc_pre` and its last post through `hc_post`; each is called here as SGLang calls it. Production
shapes are DeepSeek-V4-Flash's (4 streams x 4096, `hc_fn` [24, 16384]) at each decode batch size
and at one prefill chunk's tokens, which between them launch every mix plan; the largest decode
batch of the fused op is also captured in a CUDA graph and replayed on new inputs. Big calls are
compared with fp64 on a subset of tokens (every token is still checked for NaN). Upstream (the pinned
sm_120 `hc_pre` / `hc_post`, TileLang inside) runs at B=1 where `tilelang` imports.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, check_rows, registry_function

HIDDEN = 4096


def cases(target: Target) -> List[Case]:
    out = [
        _fused("small fused N=3", SMALL, 3, 256, target),
        _pre("small pre N=2", SMALL, 2, 128, target),
        _post("small post N=5", SMALL, 5, 128, target),
    ]
    if target.small_only:
        return out
    largest = max(target.decode_rows)
    for b in target.decode_rows:
        out.append(_fused(f"decode fused N={b}", PRODUCTION, b, HIDDEN, target, graph=b == largest))
    out.append(_pre("decode pre N=1", PRODUCTION, 1, HIDDEN, target, upstream=True))
    out.append(_post("decode post N=1", PRODUCTION, 1, HIDDEN, target, upstream=True))
    if target.prefill_rows:
        out.append(_fused(f"prefill fused N={target.prefill_rows}", PRODUCTION, target.prefill_rows, HIDDEN, target))
    return out


def _layer() -> Any:
    """The attributes `hc_pre` / `hc_post` read from a DeepSeek-V4-Flash decoder layer."""
    from v4flash_kernels.mhc import reference as R

    return SimpleNamespace(hc_mult=R.HC, hc_sinkhorn_iters=R.SINKHORN_ITERS, hc_eps=R.HC_EPS, rms_norm_eps=R.RMS_EPS)


def _inputs(n: int, hidden: int, seed: int, target: Target) -> Inputs:
    import torch

    from v4flash_kernels.mhc import reference as R

    kw: Inputs = R.make_inputs(R.MhcCase(tokens=n, hidden=hidden), device=target.device, seed=seed)
    kw["_rows"] = torch.tensor(check_rows(n, 16), device=target.device)
    return kw


def _sub(kw: Inputs, *names: str) -> List[Any]:
    r = kw["_rows"]
    return [kw[k][r] for k in names]


# ----------------------------------------------------------------------------- the fused boundary


def _fused(name: str, size: str, n: int, hidden: int, target: Target, graph: bool = False) -> Case:
    return Case(name, size, lambda seed: _inputs(n, hidden, seed, target), _fused_ours, _fused_ref, _fused_compare,
                upstream_skip="upstream's fused kernel is gated off on sm_120 (its unfused path is checked at N=1)",
                graph=graph)


def _fused_ours(kw: Inputs) -> Any:
    from v4flash_kernels.mhc import reference as R

    p = R.MhcParams()
    return registry_function("mhc_fused")(
        kw["x"], kw["residual"], kw["post"].unsqueeze(-1), kw["comb"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"],
        p.rms_eps, p.pre_eps, p.sinkhorn_eps, p.post_mult, p.iters, norm_weight=kw["norm_weight"],
        norm_eps=p.norm_eps)


def _fused_ref(kw: Inputs) -> Any:
    """The checked rows' inputs: the fp64 post and the pre of the streams ours wrote are both computed
    in the comparison (`checks.check_post_pre`), since the second depends on ours' result."""
    x, res, post, comb = _sub(kw, "x", "residual", "post", "comb")
    return dict(kw, x=x, residual=res, post=post, comb=comb)


def _fused_compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    """Streams vs the fp64 post; post, comb and the layer input vs the fp64 pre of the very streams
    ours wrote (what the unfused pair computes), so a pre that mixed anything else fails."""
    from v4flash_kernels.mhc import reference as R
    from v4flash_kernels.mhc.checks import TOL, check_post_pre

    cur, post, comb, y = out
    n, hidden = kw["x"].shape
    shapes = [tuple(t.shape) for t in out]
    if shapes != [(n, 4, hidden), (n, 4, 1), (n, 4, 4), (n, hidden)]:
        return Comparison(False, {}, f"results are {shapes}")
    r = kw["_rows"]
    res = check_post_pre(cur[r], y[r], post[r].squeeze(-1), comb[r], ref, R.MhcParams(), TOL)
    nan = _nan(out)
    metrics = dict(res["err"], nan_any=nan, rows_checked=int(r.numel()))
    ok = res["ok"] and not nan
    return Comparison(ok, metrics, "" if ok else f"errors {metrics} over tolerances {TOL}")


# ----------------------------------------------------------------------------- hc_pre / hc_post


def _pre(name: str, size: str, n: int, hidden: int, target: Target, upstream: bool = False) -> Case:
    up = _upstream_or_none(target) if upstream else None
    return Case(name, size, lambda seed: _inputs(n, hidden, seed, target), _pre_ours, _pre_ref, _pre_compare,
                upstream=(lambda kw: up.pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"])) if up else None,
                upstream_skip="" if up else _why_no_upstream(target, upstream))


def _pre_ours(kw: Inputs) -> Any:
    return registry_function("mhc_pre")(_layer(), kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"])


def _pre_ref(kw: Inputs) -> Any:
    from v4flash_kernels.mhc import reference as R

    (res,) = _sub(kw, "residual")
    ref = R.pre_ref(res, kw["hc_fn"], kw["hc_scale"], kw["hc_base"], R.MhcParams())
    ref["layer_input"] = R.layer_input_ref(ref["y"], None, R.RMS_EPS)
    return ref


def _pre_compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    from v4flash_kernels.mhc.checks import TOL, check_pre

    y, post, comb, norm_fused = out
    r = kw["_rows"]
    res = check_pre(y[r], post[r], comb[r], ref, ref["layer_input"], TOL)
    nan = _nan((y, post, comb))
    ok = res["ok"] and not nan and norm_fused is False
    metrics = dict(res["err"], nan_any=nan, norm_fused=bool(norm_fused))
    return Comparison(ok, metrics, "" if ok else f"errors {metrics} over tolerances {TOL}")


def _post(name: str, size: str, n: int, hidden: int, target: Target, upstream: bool = False) -> Case:
    up = _upstream_or_none(target) if upstream else None
    return Case(name, size, lambda seed: _inputs(n, hidden, seed, target), _post_ours, _post_ref, _post_compare,
                upstream=(lambda kw: up.post(kw["x"], kw["residual"], kw["post"], kw["comb"])) if up else None,
                upstream_skip="" if up else _why_no_upstream(target, upstream))


def _post_ours(kw: Inputs) -> Any:
    return registry_function("mhc_post")(_layer(), kw["x"], kw["residual"], kw["post"], kw["comb"])


def _post_ref(kw: Inputs) -> Any:
    from v4flash_kernels.mhc import reference as R

    return R.post_ref(*_sub(kw, "x", "residual", "post", "comb"))


def _post_compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    from v4flash_kernels.mhc.checks import TOL, check_streams

    res = check_streams(out[kw["_rows"]], ref, TOL)
    nan = _nan((out,))
    ok = res["ok"] and not nan
    metrics = dict(res["err"], nan_any=nan)
    return Comparison(ok, metrics, "" if ok else f"errors {metrics} over tolerances {TOL}")


# ----------------------------------------------------------------------------- helpers


def _nan(tensors: Any) -> bool:
    import torch

    return any(bool(torch.isnan(t.float()).any()) for t in tensors)


_UP: Dict[str, Any] = {}


def _upstream_or_none(target: Target) -> Any:
    """The pinned sm_120 `hc_pre`/`hc_post` (eager torch + TileLang), once, or None without tilelang/CUDA."""
    from v4flash_kernels.mhc import upstream

    if not target.is_cuda or not upstream.tilelang_available():
        return None
    if "up" not in _UP:
        _UP["up"] = upstream.UpstreamSm120(kind="eager")
    return _UP["up"]


def _why_no_upstream(target: Target, wanted: bool) -> str:
    if not wanted:
        return "upstream runs at N=1 only"
    return "upstream's sm_120 path needs TileLang on a GPU" + ("" if target.is_cuda else " (interpreter run)")
