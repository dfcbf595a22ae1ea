"""GPU tests of the MXFP4 MoE (run on the H200 through the device tool): real TP4 shapes, fp64
reference, upstream parity, CUDA-graph replay with changing routing; v1 (the drop-in on the
loader's fp32 scales) and v2 (repacked experts) side by side.

One set of TP4 expert weights (~1 GB, drawn on the GPU) is shared by the whole module; every test
draws its own routing and activations.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.moe.reference import MoeCase, make_routing, ref_of

pytestmark = pytest.mark.gpu

E, TOPK, HIDDEN, INTER = 256, 6, 4096, 512
CLAMP, SCALING = 10.0, 1.5


@pytest.fixture(scope="module")
def tp4():
    from v4flash_kernels.moe.repack import repack_experts

    g = torch.Generator(device="cuda").manual_seed(20261201)

    def r(shape, lo, hi):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device="cuda", generator=g)

    w13, w2 = r((E, 2 * INTER, HIDDEN // 2), 0, 256).view(torch.int8), r((E, HIDDEN, INTER // 2), 0, 256).view(torch.int8)
    s13 = r((E, 2 * INTER, HIDDEN // 32), 118, 123).view(torch.float8_e8m0fnu).to(torch.float32)
    s2 = r((E, HIDDEN, INTER // 32), 118, 123).view(torch.float8_e8m0fnu).to(torch.float32)
    return {"w13_packed": w13, "w2_packed": w2, "w13_scale": s13, "w2_scale": s2,
            "experts": repack_experts(w13, w2, s13, s2)}


def _call(tp4, tokens: int, routing: str = "random", holes: float = 0.0, seed: int = 0) -> dict:
    case = MoeCase(tokens=tokens, experts=E, topk=TOPK, hidden=HIDDEN, inter=INTER, routing=routing,
                   hole_frac=holes, clamp_limit=CLAMP, routed_scaling_factor=SCALING)
    gen = torch.Generator().manual_seed(seed)
    ids, w = make_routing(case, gen, "cuda")
    x = torch.randn((tokens, HIDDEN), generator=gen).to(torch.bfloat16).cuda()
    return dict(tp4, hidden_states=x, topk_ids=ids, topk_weights=w, hidden_size=HIDDEN, intermediate_size=INTER,
                routed_scaling_factor=SCALING, clamp_limit=CLAMP)


def _upstream_kw(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k != "experts"}


def _check(kw, out):
    M = kw["hidden_states"].shape[0]
    tokens = None if M <= 48 else torch.randperm(M, device="cuda")[:48].sort().values
    assert not torch.isnan(out.float()).any()
    err = rel_err(out if tokens is None else out[tokens], ref_of(_upstream_kw(kw), tokens))
    assert err <= 1e-2, err


def _v1(kw, out=None):
    from v4flash_kernels.moe import op as moe

    return moe.run(kw["hidden_states"], kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"],
                   kw["topk_ids"], kw["topk_weights"], kw["intermediate_size"], kw["routed_scaling_factor"],
                   kw["clamp_limit"], out=out)


def _v2(kw, out=None):
    from v4flash_kernels.moe import repacked_op

    return repacked_op.run_repacked(kw["hidden_states"], kw["experts"], kw["topk_ids"], kw["topk_weights"],
                              kw["routed_scaling_factor"], kw["clamp_limit"], out=out)


SHAPES = [(1, "random", 0.0), (2, "random", 0.5), (5, "random", 0.2), (16, "random", 0.25), (64, "hot", 0.0),
          (64, "dup", 0.0), (256, "random", 0.0), (300, "random", 0.1), (1024, "hot", 0.0), (2048, "random", 0.05),
          (4096, "random", 0.0)]


@pytest.mark.parametrize("impl", ["v1", "v2"])
@pytest.mark.parametrize("tokens,routing,holes", SHAPES)
def test_gpu_matches_fp64_and_upstream(tp4, impl, tokens, routing, holes):
    from v4flash_kernels.upstream import MOE_PATH, load_module

    kw = _call(tp4, tokens, routing, holes, seed=tokens)
    out = torch.full_like(kw["hidden_states"], float("nan"))
    (_v1 if impl == "v1" else _v2)(kw, out=out)
    _check(kw, out)
    if tokens <= 64:
        up = load_module(MOE_PATH).mxfp4_moe_forward_triton(**_upstream_kw(kw))
        assert rel_err(out, up.double()) <= 1e-2


def test_gpu_e8m0_byte_scales_equal_fp32_scales(tp4):
    from v4flash_kernels.moe import op as moe

    kw = _upstream_kw(_call(tp4, 16))
    a = moe.mxfp4_moe_forward(**kw)

    def e8m0(s):
        return (s.view(torch.int32) >> 23).to(torch.uint8).view(torch.float8_e8m0fnu)

    b = moe.mxfp4_moe_forward(**dict(kw, w13_scale=e8m0(kw["w13_scale"]), w2_scale=e8m0(kw["w2_scale"])))
    assert torch.equal(a, b)


def test_gpu_fp32_scales_that_are_not_powers_of_two(tp4):
    """The drop-in multiplies arbitrary fp32 scales in (it read only their exponent before)."""
    from v4flash_kernels.moe import op as moe

    kw = _upstream_kw(_call(tp4, 16))
    g = torch.Generator(device="cuda").manual_seed(7)
    for n in ("w13_scale", "w2_scale"):
        kw[n] = kw[n] * (1 + torch.rand(kw[n].shape, device="cuda", generator=g))
    _check(kw, moe.mxfp4_moe_forward(**kw))


@pytest.mark.parametrize("impl", ["v1", "v2"])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_gpu_cuda_graph_replay_follows_new_routing(tp4, impl, tokens):
    """Captured once; routing contents changed in place (hot expert, -1 slots, duplicates): still
    exact, and each replay of the same inputs gives the same bits (v2's split-K counters reset)."""
    fn = _v1 if impl == "v1" else _v2
    kw = _call(tp4, tokens)
    fn(kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(kw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fn(kw)
    for i, (routing, holes) in enumerate((("hot", 0.0), ("random", 0.3), ("dup", 0.0))):
        new = _call(tp4, tokens, routing, holes, seed=100 + i)
        for name in ("topk_ids", "topk_weights", "hidden_states"):
            kw[name].copy_(new[name])
        g.replay()
        torch.cuda.synchronize()
        _check(kw, out)
        first = out.clone()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


@pytest.mark.parametrize("tokens", [1024, 4096])
def test_gpu_prefill_both_operand_orders_on_repacked_layout(tp4, tokens):
    """The repacked prefill path (v1's GEMM on PAIR_SPLIT words) in the planner's operand orders and
    with both GEMMs flipped, so both bodies are checked on the GPU against fp64 with poisoned outputs
    (`bench --prefill` checks every other candidate the same way before timing it)."""
    from dataclasses import replace

    from v4flash_kernels.moe import op as moe
    from v4flash_kernels.moe import repacked_op

    kw = _call(tp4, tokens, "random", 0.05, seed=tokens + 1)
    pf = repacked_op.prefill_plan(tokens, TOPK, E, HIDDEN, INTER)
    flipped = moe.Plan(False, replace(pf.gemm1, mode=1 - pf.gemm1.mode), replace(pf.gemm2, mode=1 - pf.gemm2.mode))
    for plan in (pf, flipped):
        out = torch.full_like(kw["hidden_states"], float("nan"))
        repacked_op.run_repacked(kw["hidden_states"], kw["experts"], kw["topk_ids"], kw["topk_weights"],
                           kw["routed_scaling_factor"], kw["clamp_limit"], plan=plan, out=out)
        _check(kw, out)
