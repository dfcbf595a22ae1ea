"""mHC kernels under Triton's CPU interpreter: fp64 reference, the wheel's torch path, the drop-in contracts.

Tolerances are the GPU's: the kernels spell out round-to-nearest under the interpreter (which
truncates) and multiply in fp32 where its bf16 dot is wrong (kernel.py), so the only difference
from a GPU run is the dot's operand type, not the values.

The wheel's sm_120 path is run from its own source (read at run time): `DeepseekV4DecoderLayer.hc_pre`
(torch GEMV + RMS + combine) and `hc_post` (its torch branch, i.e. with SGLang's TileLang post
switched off). Its Sinkhorn is a TileLang kernel, which cannot run on a CPU: the reference's split
stands in for it (`bench.sinkhorn_standin`); the GPU test uses the real one.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

import v4flash_bench.mhc as B
from v4flash_kernels import upstream as _up
from v4flash_kernels.kit.device import arrival_counters
from v4flash_kernels.mhc import checks as C
from v4flash_kernels.mhc import op
from v4flash_kernels.mhc import reference as R
from v4flash_kernels.mhc import upstream as U

TOL = C.TOL


def _inputs(n: int, hidden: int, seed: int = 0, params: R.MhcParams = R.MhcParams(), norm: bool = True):
    return R.make_inputs(R.MhcCase(tokens=n, hidden=hidden, norm=norm, params=params), seed=seed)


def _common(p: R.MhcParams) -> dict:
    return {"rms_eps": p.rms_eps, "hc_eps": p.pre_eps, "sinkhorn_eps": p.sinkhorn_eps, "sinkhorn_iters": p.iters,
                "post_mult": p.post_mult}


def _layer(p: R.MhcParams = R.MhcParams()):
    return SimpleNamespace(hc_mult=4, hc_sinkhorn_iters=p.iters, hc_eps=p.pre_eps, rms_norm_eps=p.rms_eps)


# ----------------------------------------------------------------------------- against fp64


@pytest.mark.parametrize("n,hidden,norm", [
    (1, 4096, False),  # decode, the model's hidden size
    (3, 4096, True),
    (16, 256, True),
    (17, 320, False),  # odd token count, hidden not a power of two
    (100, 192, True),  # prefill plan: two 64-token blocks, the second partial
], ids=["b1", "b3_norm", "b16_norm", "b17_h320", "b100_prefill"])
def test_pre_matches_fp64_reference(n, hidden, norm):
    p = R.MhcParams()
    kw = _inputs(n, hidden, seed=n)
    w = kw["norm_weight"] if norm else None
    y, post, comb = op.mhc_pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], **_common(p),
                               norm_weight=w, norm_eps=p.norm_eps if norm else None)
    ref = R.pre_ref(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], p)
    res = C.check_pre(y, post, comb, ref, R.layer_input_ref(ref["y"], w, p.norm_eps), TOL, normed=norm)
    assert res["ok"], res
    assert y.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    assert tuple(y.shape) == (n, hidden) and tuple(post.shape) == (n, 4) and tuple(comb.shape) == (n, 4, 4)


@pytest.mark.parametrize("iters,eps,post_mult", [(1, 0.05, 2.0), (2, 0.05, 1.5), (3, 0.2, 2.0), (20, 0.05, 2.0)])
def test_split_semantics_with_large_eps(iters, eps, post_mult):
    """With eps this large every place eps enters (pre, softmax, each normalisation) moves comb by
    far more than the tolerance, as do the iteration count and the post multiplier."""
    p = R.MhcParams(pre_eps=eps, sinkhorn_eps=eps, iters=iters, post_mult=post_mult)
    kw = _inputs(5, 128, seed=iters, params=p, norm=False)
    y, post, comb = op.mhc_pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], **_common(p))
    ref = R.pre_ref(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], p)
    res = C.check_pre(y, post, comb, ref, R.layer_input_ref(ref["y"], None, p.norm_eps), TOL)
    assert res["ok"], res
    # The test can fail: eps left out of the normalisations, or (before convergence) one more
    # iteration, moves comb far beyond the tolerance.
    others = [dataclasses.replace(p, sinkhorn_eps=0.0)] + ([dataclasses.replace(p, iters=iters + 1)] if iters <= 3 else [])
    for q in others:
        other = R.pre_ref(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], q)
        assert R.max_abs(comb, other["comb"]) > 10 * TOL["mix"], q


def test_pre_eps_and_sinkhorn_eps_are_separate():
    p = R.MhcParams(pre_eps=0.1, sinkhorn_eps=0.01, iters=4)
    kw = _inputs(2, 128, seed=3, params=p, norm=False)
    y, post, comb = op.mhc_pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], **_common(p))
    ref = R.pre_ref(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], p)
    assert C.check_pre(y, post, comb, ref, R.layer_input_ref(ref["y"], None, p.norm_eps), TOL)["ok"]


@pytest.mark.parametrize("n,hidden", [(1, 4096), (5, 300), (70, 128)])
def test_post_matches_fp64_reference(n, hidden):
    kw = _inputs(n, hidden, seed=n)
    for post in (kw["post"], kw["post"].unsqueeze(-1)):  # [N, 4] and [N, 4, 1], as SGLang passes both
        out = op.mhc_post(kw["x"], kw["residual"], post, kw["comb"])
        res = C.check_streams(out, R.post_ref(kw["x"], kw["residual"], kw["post"], kw["comb"]), TOL)
        assert res["ok"], res


@pytest.mark.parametrize("n,hidden", [(1, 4096), (6, 256), (65, 128)])
def test_post_pre_matches_fp64_reference(n, hidden):
    """The fused boundary end to end: streams against the fp64 post, post / comb / normalised layer
    input against the fp64 pre of exactly the streams it wrote."""
    p = R.MhcParams()
    kw = _inputs(n, hidden, seed=10 + n)
    out = op.mhc_post_pre(kw["x"], kw["residual"], kw["post"], kw["comb"], kw["hc_fn"], kw["hc_scale"],
                          kw["hc_base"], **_common(p), norm_weight=kw["norm_weight"], norm_eps=p.norm_eps)
    res = C.check_post_pre(*out, kw, p, TOL)
    assert res["ok"], res


# Tokens 1 and 16: the decode plan, one token block; 64: its largest block; 100: the prefill plan
# (two 64-token blocks, the second partial). Hidden sizes keep the interpreter quick.
PAIR_SIZES = [(1, 4096), (16, 1024), (64, 512), (100, 256)]


@pytest.mark.parametrize("n,hidden", PAIR_SIZES, ids=[f"n{n}" for n, _ in PAIR_SIZES])
def test_fused_is_the_unfused_pair(n, hidden):
    """The fused op computes what the unfused pair computes on the same inputs (the post, then the
    pre and the RMSNorm of the bf16 streams that post wrote): here the same bits."""
    p = R.MhcParams()
    kw = _inputs(n, hidden, seed=30 + n)
    fused = op.mhc_post_pre(kw["x"], kw["residual"], kw["post"], kw["comb"], kw["hc_fn"], kw["hc_scale"],
                            kw["hc_base"], **_common(p), norm_weight=kw["norm_weight"], norm_eps=p.norm_eps)
    cur = op.mhc_post(kw["x"], kw["residual"], kw["post"], kw["comb"])
    pair = (cur, *op.mhc_pre(cur, kw["hc_fn"], kw["hc_scale"], kw["hc_base"], **_common(p),
                             norm_weight=kw["norm_weight"], norm_eps=p.norm_eps))
    for name, a, b in zip(("streams", "y", "post", "comb"), fused, pair):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    res = C.check_against_pair(fused, pair, TOL)
    assert res["ok"] and res["err"]["pair_stream_elems"] == 0 and res["err"]["pair_post"] == 0.0, res


def _fp32_post(kw) -> torch.Tensor:
    """A post as any fp32 kernel computes it (upstream's TileLang and torch ones, ours): fp32, then bf16."""
    out = kw["post"].float()[:, :, None] * kw["x"].float()[:, None, :]
    for k in range(4):
        out = out + kw["comb"].float()[:, k, :, None] * kw["residual"].float()[:, k:k + 1, :]
    return out.to(torch.bfloat16)


def _fused_result(cur, mixed_from, kw, p):
    """(streams, layer input, post, comb) of a fused op that wrote `cur` and mixed `mixed_from` exactly."""
    ref = R.pre_of_streams(mixed_from, kw, p)
    return cur, ref["layer_input"].to(torch.bfloat16), ref["post"].float(), ref["comb"].float()


@pytest.mark.parametrize("n", [1, 16, 64, 100])
def test_fused_check_is_the_unfused_pair(n):
    """`check_post_pre` accepts exactly what an unfused pair computes and rejects a pre of anything else.

    The pair: an fp32 post rounded to bf16, then the exact pre of those streams. The pre of the fp64
    post rounded instead (the previous check's reference) is not that: ~0.5 elements per token sit
    within fp32 error of a bf16 tie and round the other way, each moving a mix by up to ~1e-4, so
    the previous check failed correct results from 16 tokens on (here at 100 tokens; on the H200
    every fused row from 64 tokens). Rejected: a pre that mixed the unrounded streams (the bf16
    rounding of all 16K elements: >= 1e-3 even at one token) or the previous streams.
    """
    p = R.MhcParams()
    kw = _inputs(n, 4096, seed=2)
    cur = _fp32_post(kw)
    exact = R.post_ref(kw["x"], kw["residual"], kw["post"], kw["comb"])
    pair = _fused_result(cur, cur, kw, p)
    res = C.check_post_pre(*pair, kw, p, TOL)
    assert res["ok"] and res["err"]["post"] < 1e-6 and res["err"]["comb"] < 1e-6, res
    if n == 100:
        assert res["err"]["ties"] > 0
        rounded = R.pre_of_streams(exact.to(torch.bfloat16), kw, p)
        assert R.max_abs(pair[2], rounded["post"]) > TOL["mix"]  # the previous check's false failure
    for wrong in (exact, kw["residual"]):
        bad = C.check_post_pre(*_fused_result(cur, wrong, kw, p), kw, p, TOL)
        assert not bad["ok"] and max(bad["err"]["post"], bad["err"]["comb"]) > 5 * TOL["mix"], bad
    truncated = (exact.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    bad = C.check_post_pre(*_fused_result(truncated, truncated, kw, p), kw, p, TOL)
    assert not bad["ok"] and bad["err"]["ties"] > 1000 * n, bad  # a wrong rounding mode: half the elements


def test_selfcheck_fused_case_rejects_a_pre_of_other_streams():
    """The self-check's fused comparison is the same check: the pair passes, a pre of the unrounded
    streams fails (shapes as SGLang receives them)."""
    from v4flash_kernels.mhc import selfcheck as S

    p = R.MhcParams()
    kw = _inputs(16, 4096, seed=4)
    kw["_rows"] = torch.arange(16)
    cur = _fp32_post(kw)
    exact = R.post_ref(kw["x"], kw["residual"], kw["post"], kw["comb"])
    ref = S._fused_ref(kw)
    for mixed_from, ok in ((cur, True), (exact, False)):
        c, y, post, comb = _fused_result(cur, mixed_from, kw, p)
        verdict = S._fused_compare((c, post.unsqueeze(-1), comb, y), ref, kw)
        assert verdict.ok is ok, verdict


def test_deterministic_bitwise_and_tickets_left_at_zero():
    p = R.MhcParams()
    kw = _inputs(3, 256, seed=7)
    args = (kw["x"], kw["residual"], kw["post"], kw["comb"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"])
    assert op.plan_for(3, 256, 4).one_launch
    a = op.mhc_post_pre(*args, **_common(p), norm_weight=kw["norm_weight"], norm_eps=p.norm_eps)
    b = op.mhc_post_pre(*args, **_common(p), norm_weight=kw["norm_weight"], norm_eps=p.norm_eps)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert int(arrival_counters(torch.device("cpu"), 64).abs().sum()) == 0  # graph replays need no reset


class _Launches:
    """Stands in for the kernel module and counts launches per kernel."""

    def __init__(self, real):
        self.real, self.count = real, {}

    def __getattr__(self, name):
        kern = getattr(self.real, name)
        if not hasattr(kern, "__getitem__"):
            return kern
        launches = self

        class _K:
            def __getitem__(self, grid):
                launches.count[name] = launches.count.get(name, 0) + 1
                return kern[grid]
        return _K()


@pytest.mark.parametrize("n", [1, 5, 64, 65])
def test_decode_boundary_is_one_launch(n, monkeypatch):
    p = R.MhcParams()
    kw = _inputs(n, 64, seed=n)
    counter = _Launches(op._k)
    monkeypatch.setattr(op, "_k", counter)
    op.mhc_post_pre(kw["x"], kw["residual"], kw["post"], kw["comb"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"],
                    **_common(p), norm_weight=kw["norm_weight"], norm_eps=p.norm_eps)
    op.mhc_pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], **_common(p))
    want = {"mix_kernel": 2} if n <= op.DECODE_MAX_TOKENS else {"mix_kernel": 2, "finish_kernel": 2}
    assert counter.count == want


@pytest.mark.parametrize("n", [4, 6])
def test_every_decode_split_plan_agrees(n):
    """One-launch plans with 1..16 tokens per block and 1..8 hidden tiles per program (the tile
    ahead requested early; the hidden size 200 leaves a partial and an empty last tile), and the
    two-launch plans, give the same result, fused and not."""
    p = R.MhcParams()
    hidden = 200
    kw = _inputs(n, hidden, seed=5)
    ref = R.pre_ref(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], p)
    li = R.layer_input_ref(ref["y"], None, p.norm_eps)
    plans = (op.decode_plan(1, 8, hidden), op.decode_plan(4, 2, hidden), op.decode_plan(16, 1, hidden),
             op.decode_plan(2, 3, hidden), op.make_plan(16, 8, 32, hidden), op.make_plan(32, 2, 64, hidden))
    assert {pl.h_per_split // pl.block_h for pl in plans} >= {1, 4, 7}
    fused = []
    for plan in plans:
        y, post, comb = op.mhc_pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], **_common(p), plan=plan)
        assert C.check_pre(y, post, comb, ref, li, TOL)["ok"], plan
        out = op.mhc_post_pre(kw["x"], kw["residual"], kw["post"], kw["comb"], kw["hc_fn"], kw["hc_scale"],
                              kw["hc_base"], **_common(p), norm_weight=kw["norm_weight"], norm_eps=p.norm_eps,
                              plan=plan)
        res = C.check_post_pre(*out, kw, p, TOL)
        assert res["ok"], (plan, res)
        fused.append(out)
    for out in fused[1:]:  # the streams are the same bits whatever the plan
        assert torch.equal(out[0], fused[0][0])


# ----------------------------------------------------------------------------- against the wheel's torch path


def test_matches_the_wheels_torch_path():
    p = R.MhcParams()
    up = U.UpstreamSm120(p, kind="torch")
    kw = _inputs(3, 512, seed=11)
    uy, upost, ucomb, unorm = up.pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"])
    uout = up.post(kw["x"], kw["residual"], kw["post"], kw["comb"])
    oy, opost, ocomb, onorm = op.hc_pre(_layer(p), kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"])
    oout = op.hc_post(_layer(p), kw["x"], kw["residual"], kw["post"], kw["comb"])
    assert unorm is False and onorm is False
    for u, o in ((uy, oy), (upost, opost), (ucomb, ocomb), (uout, oout)):
        assert u.dtype == o.dtype and u.shape == o.shape
    ref = R.pre_ref(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], p)
    li = R.layer_input_ref(ref["y"], None, p.norm_eps)
    up_res = C.check_pre(uy, upost, ucomb, ref, li, TOL)
    assert up_res["ok"], up_res
    assert C.check_pre(oy, opost, ocomb, ref, li, TOL)["ok"]
    assert R.max_rel(oy, uy.double()) <= TOL["bf16"]
    assert R.max_abs(opost, upost) <= TOL["mix"] and R.max_abs(ocomb, ucomb) <= TOL["mix"]
    assert R.max_rel(oout, uout.double()) <= TOL["bf16"]


def test_bench_row_on_cpu():
    """The bench's per-shape routine (checks, sweep, upstream torch path) end to end, timer stubbed."""
    row = B.run_tokens(2, 0, U.UpstreamSm120(kind="torch"), None, sweep=True, device="cpu", hidden=128,
                       timer=lambda fn: (fn(), 1.0)[1])
    v = row["variants"]
    assert {"pre", "pre_norm", "post", "post_pre", "upstream_sm120_pre", "upstream_sm120_post"} <= set(v)
    assert all(x["ok"] for x in v.values()), v
    assert all(x.get("us", 1.0) == 1.0 for k, x in v.items() if k != "post_pre_chain"), v
    assert v["post_pre_chain"]["us"] == 1.0 / B.CHAIN and row["layer_us"]["ours_chain"] == 2.0 / B.CHAIN
    assert {k[6:] for k in v if k.startswith("sweep:")} == {p.name for p in B.sweep_plans(2, 128)}
    assert v["post_pre_vs_pair"]["err"]["pair_stream_elems"] == 0
    assert any(k.startswith("sweep:") for k in v) and row["layer_us"]["ours"] == 2.0
    assert "FAIL" not in B.format_table([row])


# ----------------------------------------------------------------------------- drop-in contracts


def _upstream_params(path: str, qual: str) -> list:
    """(name, kind, has_default) of an upstream function/method, parsed from the wheel's source."""
    text, _ = _up.source_of(path)
    tree = ast.parse(text)
    parts = qual.split(".")
    body = tree.body
    node = None
    for name in parts:
        node = next(n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
        body = node.body
    a = node.args
    pos = [(x.arg, "POSITIONAL_OR_KEYWORD") for x in a.args]
    nd = len(a.args) - len(a.defaults)
    out = [(n, k, i >= nd) for i, (n, k) in enumerate(pos)]
    out += [(x.arg, "KEYWORD_ONLY", d is not None) for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    return out


@pytest.mark.parametrize("qual,path,ours", [
    ("DeepseekV4DecoderLayer.hc_pre", U.MODEL_PATH, op.hc_pre),
    ("DeepseekV4DecoderLayer.hc_post", U.MODEL_PATH, op.hc_post),
    ("_is_fused_mhc_post_pre_enabled", U.MODEL_PATH, op.fused_post_pre_enabled),
    ("mhc_fused_post_pre", U.MHC_PATH, op.mhc_fused_post_pre),
])
def test_dropin_signatures_match_the_wheel(qual, path, ours):
    mine = [(p.name, p.kind.name, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(ours).parameters.values()]
    assert mine == _upstream_params(path, qual)


def test_hc_pre_and_hc_post_dropins_handle_empty_batches():
    layer = _layer()
    x = torch.empty((0, 4, 64), dtype=torch.bfloat16)
    fn = torch.zeros(24, 256)
    y, post, comb, fused = op.hc_pre(layer, x, fn, torch.ones(3), torch.zeros(24))
    assert y.shape == (0, 64) and post.shape == (0, 4) and comb.shape == (0, 4, 4) and fused is False
    assert y.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    out = op.hc_post(layer, torch.empty((0, 64), dtype=torch.bfloat16), x, post, comb)
    assert out.shape == (0, 4, 64) and out.dtype == torch.bfloat16


def test_fused_dropin_shapes_outer_dims_and_empty():
    p = R.MhcParams()
    kw = _inputs(6, 128, seed=2)
    args = (kw["hc_fn"], kw["hc_scale"], kw["hc_base"], p.rms_eps, p.pre_eps, p.sinkhorn_eps, p.post_mult, p.iters)
    flat = op.mhc_fused_post_pre(kw["x"], kw["residual"], kw["post"].unsqueeze(-1), kw["comb"], *args,
                                 norm_weight=kw["norm_weight"], norm_eps=p.norm_eps)
    cur, post, comb, li = flat
    assert cur.shape == (6, 4, 128) and post.shape == (6, 4, 1) and comb.shape == (6, 4, 4) and li.shape == (6, 128)
    # An outer shape [2, 3], a [.., 4] post, a non-contiguous residual: same numbers.
    res_nc = kw["residual"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not res_nc.is_contiguous()
    outer = op.mhc_fused_post_pre(kw["x"].view(2, 3, 128), res_nc.view(2, 3, 4, 128), kw["post"].view(2, 3, 4),
                                  kw["comb"].view(2, 3, 4, 4), *args, norm_weight=kw["norm_weight"],
                                  norm_eps=p.norm_eps)
    assert [tuple(t.shape) for t in outer] == [(2, 3, 4, 128), (2, 3, 4, 1), (2, 3, 4, 4), (2, 3, 128)]
    for a, b in zip(flat, outer):
        assert torch.equal(a.reshape(-1), b.reshape(-1))
    # Without a norm weight the layer input is the plain mix.
    _, _, _, plain = op.mhc_fused_post_pre(kw["x"], kw["residual"], kw["post"], kw["comb"], *args)
    ref = R.pre_ref(cur, kw["hc_fn"], kw["hc_scale"], kw["hc_base"], p)
    assert R.max_rel(plain, R.layer_input_ref(ref["y"], None, p.norm_eps)) <= TOL["bf16"]
    e = op.mhc_fused_post_pre(kw["x"][:0], kw["residual"][:0], kw["post"][:0].unsqueeze(-1), kw["comb"][:0], *args,
                              norm_weight=kw["norm_weight"], norm_eps=p.norm_eps)
    assert [tuple(t.shape) for t in e] == [(0, 4, 128), (0, 4, 1), (0, 4, 4), (0, 128)]
    assert [t.dtype for t in e] == [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]


def test_unsupported_inputs_raise():
    kw = _inputs(2, 64, seed=1)
    with pytest.raises(NotImplementedError, match="hc_mult=4"):
        op.mhc_pre(kw["residual"][:, :3], kw["hc_fn"][:, :192], kw["hc_scale"], kw["hc_base"], rms_eps=1e-6,
                   hc_eps=1e-6, sinkhorn_iters=20)
    with pytest.raises(AssertionError, match="bf16"):
        op.mhc_pre(kw["residual"].float(), kw["hc_fn"], kw["hc_scale"], kw["hc_base"], rms_eps=1e-6, hc_eps=1e-6,
                   sinkhorn_iters=20)
    with pytest.raises(AssertionError, match="hc_fn"):
        op.mhc_pre(kw["residual"], kw["hc_fn"][:, :128], kw["hc_scale"], kw["hc_base"], rms_eps=1e-6, hc_eps=1e-6,
                   sinkhorn_iters=20)
    with pytest.raises(AssertionError, match="norm_eps"):
        op.mhc_pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], rms_eps=1e-6, hc_eps=1e-6,
                   sinkhorn_iters=20, norm_weight=kw["norm_weight"])


def test_fused_post_pre_enabled_only_while_ours_is_the_models_fused_op(monkeypatch):
    import types

    assert op.fused_post_pre_enabled() is False  # no deepseek_v4 loaded
    model = types.ModuleType(op.DSV4_MODULE)
    model.mhc_fused_post_pre = lambda *a, **k: None  # upstream's (or anything else)
    monkeypatch.setitem(__import__("sys").modules, op.DSV4_MODULE, model)
    assert op.fused_post_pre_enabled() is False
    model.mhc_fused_post_pre = op.mhc_fused_post_pre
    assert op.fused_post_pre_enabled() is True


# ----------------------------------------------------------------------------- the planner


@pytest.mark.parametrize("n", [1, 2, 16, 17, 64, 65, 1000, 1024, 4097, 8192, 65536])
@pytest.mark.parametrize("hidden", [4096, 320, 7168])
def test_plan_covers_the_hidden_dimension_once(n, hidden):
    for sms in (84, 132, 188):
        plan = op.plan_for(n, hidden, sms)
        assert plan.h_per_split % plan.block_h == 0 and plan.block_h >= 16 and plan.block_t >= 16
        assert plan.splits * plan.h_per_split >= hidden > (plan.splits - 1) * plan.h_per_split
        if n <= op.DECODE_MAX_TOKENS:
            # One launch, one wave: few token blocks (each re-reads hc_fn from L2), ~128 programs.
            blocks = -(-n // plan.tokens)
            assert plan.one_launch and plan.block_t >= max(16, plan.tokens)
            assert blocks <= op.DECODE_MAX_BLOCKS and blocks * plan.splits <= op.DECODE_PROGRAMS
        else:
            assert not plan.one_launch
        assert plan == op.plan_for(n, hidden, sms)  # pure function of the shape


def test_launchable_lists_every_plan_shape():
    kinds = {(p.block_t, p.block_h, p.num_warps, p.tokens) for p in op.launchable()}
    for n in range(1, op.DECODE_MAX_TOKENS + 2):
        p = op.plan_for(n, 4096, 132)
        assert (p.block_t, p.block_h, p.num_warps, p.tokens) in kinds
    for n in (100, 8192):
        p = op.plan_for(n, 4096, 132)
        assert (p.block_t, p.block_h, p.num_warps, p.tokens) in kinds
