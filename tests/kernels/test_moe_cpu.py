"""CPU tests of the grouped MXFP4 MoE kernels under TRITON_INTERPRET=1 (small shapes).

Every kernel check compares against the fp64 reference written from the MXFP4 definition
(moe/reference.py), with the output NaN-poisoned beforehand so an unwritten element cannot pass;
one case also runs the pinned upstream function (from the sglang wheel) under the interpreter.
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch

from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.moe import kernel, repack, repacked_op
from v4flash_kernels.moe import op as moe
from v4flash_kernels.moe.reference import (
    MoeCase,
    dequant,
    e2m1_values,
    make_inputs,
    ref_of,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)

REL_TOL = 1e-2
# Small tiles so the interpreter stays quick and M spans several row blocks.
SMALL_G1 = moe.GemmConfig(16, 16, 64, 4, 1)
SMALL_G2 = moe.GemmConfig(16, 32, 64, 4, 1)
INLINE = moe.Plan(True, SMALL_G1, SMALL_G2)
SORTED = moe.Plan(False, SMALL_G1, SMALL_G2)


def _call(kw, plan=None):
    out = torch.full_like(kw["hidden_states"], float("nan"))
    o = moe.run(
        kw["hidden_states"], kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"],
        kw["topk_ids"], kw["topk_weights"], kw["intermediate_size"],
        kw["routed_scaling_factor"], kw["clamp_limit"], plan=plan, out=out,
    )
    assert o.data_ptr() == out.data_ptr()
    return o


def _assert_matches(kw, out):
    assert out.dtype == kw["hidden_states"].dtype and out.shape == kw["hidden_states"].shape
    assert not torch.isnan(out.float()).any(), "NaN (or unwritten) output element"
    ref = ref_of(kw)
    err = rel_err(out, ref)
    assert err <= REL_TOL, err
    return ref


CASES = {
    # -1 slots, clamp active (small limit), scaling on, fp32 scales, M=5 (no block multiple).
    "holes_clamp_scale": MoeCase(tokens=5, hole_frac=0.3, clamp_limit=0.4, routed_scaling_factor=2.5),
    # top-1 routing, no clamp, no scaling, e8m0 byte scales, M=7.
    "top1_e8m0_plain": MoeCase(tokens=7, topk=1, scale_e8m0=True),
    # clamp_limit 0 means "no clamp" (upstream's rule: only a positive limit clamps).
    "clamp_zero_is_off": MoeCase(tokens=3, topk=2, clamp_limit=0.0, routed_scaling_factor=1.0),
    # Every token on expert 0 (19 rows: two 16-row blocks) plus 5 other experts each.
    "hot_expert": MoeCase(tokens=19, topk=3, routing="hot", clamp_limit=0.4),
    # All tokens on the same 2 experts in two orders (duplicate experts across tokens).
    "dup_experts": MoeCase(tokens=6, topk=2, routing="dup", routed_scaling_factor=0.7),
}


@pytest.mark.parametrize("plan", [INLINE, SORTED], ids=["inline", "sorted"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_fp64_reference(name, plan):
    kw = make_inputs(CASES[name])  # fresh random inputs every run
    _assert_matches(kw, _call(kw, plan))


MODES = {
    "w_left_operand": moe.Plan(True, moe.GemmConfig(16, 16, 64, 4, 1, mode=1), moe.GemmConfig(16, 32, 64, 4, 1, mode=1)),
    "fma_rows2": moe.Plan(False, moe.GemmConfig(2, 16, 64, 4, 1, mode=2), moe.GemmConfig(2, 32, 64, 4, 1, mode=2)),
    "fma_prefetch": moe.Plan(True, moe.GemmConfig(1, 16, 32, 4, 1, mode=3), moe.GemmConfig(1, 32, 32, 4, 1, mode=3)),
    "split_k4_dot": moe.Plan(True, moe.GemmConfig(16, 16, 32, 4, 1, split_k=4), SMALL_G2),
    "split_k2_fma_sorted": moe.Plan(False, moe.GemmConfig(1, 16, 32, 4, 1, mode=3, split_k=2),
                                    moe.GemmConfig(2, 32, 32, 4, 1, mode=3)),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_gemm_mode_matches_fp64(mode):
    """The alternative GEMM bodies (W as left operand, FMA, prefetch, split-K + activation in GEMM2)."""
    kw = make_inputs(MoeCase(tokens=4, topk=4, hole_frac=0.2, clamp_limit=0.4, routed_scaling_factor=1.7))
    _assert_matches(kw, _call(kw, MODES[mode]))


def test_clamp_and_scaling_are_applied():
    """The same inputs with clamp/scaling toggled give different outputs, each matching fp64."""
    kw = make_inputs(MoeCase(tokens=4, topk=3, clamp_limit=0.3, routed_scaling_factor=2.0))
    with_both = _call(kw, INLINE)
    _assert_matches(kw, with_both)
    plain = dict(kw, clamp_limit=None, routed_scaling_factor=None)
    without = _call(plain, INLINE)
    _assert_matches(plain, without)
    assert rel_err(with_both, without.double()) > 0.05


def _upstream():
    """The pinned upstream module (cached by load_module) with one autotune config: the
    interpreter has no benchmarker to choose between several."""
    from v4flash_kernels.upstream import MOE_PATH, load_module

    up = load_module(MOE_PATH)
    kernel = up._mxfp4_slot_gemv_kernel
    kernel.configs = kernel.configs[1:2] if len(kernel.configs) > 1 else kernel.configs
    return up


def test_matches_upstream_under_interpreter():
    """Ours vs the pinned upstream function executed under the interpreter, and both vs fp64.

    The interpreter truncates fp32 -> bf16 (no round-to-nearest); upstream rounds four times
    through bf16 buffers, so its own error is ~1 %: ours must be within 3 % of it and 1 % of fp64.
    """
    up = _upstream()
    kw = make_inputs(MoeCase(tokens=3, hole_frac=0.25, clamp_limit=0.4, routed_scaling_factor=2.5))
    ours = moe.mxfp4_moe_forward(**kw)
    theirs = up.mxfp4_moe_forward_triton(**kw)
    ref = _assert_matches(kw, ours)
    assert rel_err(theirs, ref) <= 3e-2
    assert rel_err(ours, theirs.double()) <= 3e-2


def _any_fp32_scales(kw: dict, gen: torch.Generator) -> dict:
    """The call with fp32 scales that are not powers of two (random mantissas, a few negative and
    zero): upstream multiplies them in; reading only their exponent was 60-80 % off."""
    out = dict(kw)
    for n in ("w13_scale", "w2_scale"):
        s = kw[n].float() * (1 + torch.rand(kw[n].shape, generator=gen))
        flip = torch.rand(s.shape, generator=gen)
        s = torch.where(flip < 0.05, -s, s)
        out[n] = torch.where(flip > 0.98, torch.zeros_like(s), s)
    return out


@pytest.mark.parametrize("plan", [None, SORTED], ids=["planner", "sorted"])
def test_fp32_scales_that_are_not_powers_of_two_are_exact(plan):
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    kw = _any_fp32_scales(make_inputs(MoeCase(tokens=5, hole_frac=0.2, clamp_limit=7.0, routed_scaling_factor=1.5)), g)
    assert ((kw["w13_scale"].view(torch.int32) & 0x7FFFFF) != 0).any()
    _assert_matches(kw, _call(kw, plan))


def test_e8m0_bytes_outside_the_fast_range_are_exact():
    """e8m0 scales far from MXFP4's usual 2^-9..2^-5: 2^-127 (byte 0), below 2^-62 and above 2^64
    (the exponent-only decode's limits), as float8_e8m0fnu. Upstream converts them with .to(fp32)."""
    from v4flash_kernels.moe import kernel as k

    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    kw = make_inputs(MoeCase(tokens=4, topk=3, scale_e8m0=True, routed_scaling_factor=0.5))
    s13 = torch.randint(110, 135, kw["w13_scale"].shape, generator=g, dtype=torch.uint8)
    s13[:, ::5, 0] = 0  # 2^-127
    s13[:, 1::5, 1] = k.FAST_MIN_BYTE - 20
    s2 = torch.randint(k.FAST_MAX_BYTE + 1, k.FAST_MAX_BYTE + 10, kw["w2_scale"].shape, generator=g, dtype=torch.uint8)
    kw = dict(kw, w13_scale=s13.view(torch.float8_e8m0fnu), w2_scale=s2.view(torch.float8_e8m0fnu))
    out = _call(kw, INLINE)
    assert torch.isfinite(out.float()).all()
    _assert_matches(kw, out)


def test_integer_scale_dtypes_are_taken_by_value_as_upstream_does():
    """uint8 scales mean their integer values to upstream (`.to(torch.float32)`), not e8m0 bytes."""
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    kw = make_inputs(MoeCase(tokens=3, topk=2, routed_scaling_factor=1e-4))
    kw = dict(kw, w13_scale=torch.randint(1, 4, kw["w13_scale"].shape, generator=g, dtype=torch.uint8),
              w2_scale=torch.randint(1, 4, kw["w2_scale"].shape, generator=g, dtype=torch.uint8))
    _assert_matches(kw, _call(kw, SORTED))


def test_matches_upstream_on_fp32_scales_that_are_not_powers_of_two():
    up = _upstream()
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    kw = _any_fp32_scales(make_inputs(MoeCase(tokens=2, clamp_limit=7.0, routed_scaling_factor=1.5)), g)
    ours = moe.mxfp4_moe_forward(**kw)
    theirs = up.mxfp4_moe_forward_triton(**kw)
    ref = _assert_matches(kw, ours)
    assert rel_err(theirs, ref) <= 3e-2
    assert rel_err(ours, theirs.double()) <= 3e-2


def test_signature_is_upstreams():
    from v4flash_kernels.upstream import MOE_PATH, load_module

    up = inspect.signature(load_module(MOE_PATH).mxfp4_moe_forward_triton)
    ours = inspect.signature(moe.mxfp4_moe_forward)
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in up.parameters.values()]


def test_reference_dequant_follows_the_definition():
    """Byte 0x2F = low nibble 0xF (-6, even k) then high nibble 0x2 (+1.0, odd k); scales 2^(b-127)."""
    vals = e2m1_values()
    assert vals.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    packed = torch.full((1, 16), 0x2F, dtype=torch.uint8)
    scale = torch.tensor([[130]], dtype=torch.uint8)
    w = dequant(packed, scale.view(torch.float8_e8m0fnu))  # 2^3
    assert w.shape == (1, 32)
    assert w[0, 0].item() == -48.0 and w[0, 1].item() == 8.0
    assert torch.equal(dequant(packed, scale.view(torch.float8_e8m0fnu).to(torch.float32)), w)
    assert dequant(packed, scale).abs().max().item() == 6 * 130  # a uint8 scale is a value, as upstream


@pytest.mark.parametrize("trial", range(3))
def test_sort_prep_groups_every_valid_slot_once(trial):
    """The counting-sort prep: each valid slot once, in its expert's blocks, in slot order."""
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    E, topk, M, bm = 16, 4, int(torch.randint(1, 90, (1,), generator=g)), 16
    ids = torch.randint(0, E, (M, topk), generator=g, dtype=torch.int32)
    ids[torch.rand((M, topk), generator=g) < 0.2] = -1
    if trial == 2:
        ids[:, 0] = 3  # hot expert
    flat = ids.reshape(-1).contiguous()
    S = flat.numel()
    sorted_, blk_e, blk_r, nb = moe._sort_slots(flat, S, E, bm)
    assert nb == moe.max_blocks(S, E, bm)
    seen = []
    for b in range(nb):
        e, r = int(blk_e[b]), int(blk_r[b])
        if e < 0:
            assert r == 0
            continue
        assert 1 <= r <= bm
        rows = sorted_[b * bm: b * bm + r].tolist()
        assert all(int(flat[s]) == e for s in rows)
        seen += rows
    live = [int(x) for x in blk_e if x >= 0]
    assert live == sorted(live), "blocks are grouped by expert in expert order"
    assert sorted(seen) == [s for s in range(S) if flat[s] >= 0]
    by_expert = {}
    for s in seen:
        by_expert.setdefault(int(flat[s]), []).append(s)
    assert all(v == sorted(v) for v in by_expert.values()), "stable: slot order kept within an expert"


def test_max_blocks_bounds_every_routing():
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    for S, E, bm in [(6, 256, 16), (96, 256, 16), (24576, 256, 64), (7, 3, 128), (300, 8, 16)]:
        n = min(S, E)
        worst_case = [S - (n - 1)] + [1] * (n - 1)  # one hot expert, every other expert one slot
        random_case = torch.bincount(torch.randint(0, E, (S,), generator=g), minlength=E).tolist()
        for counts in (worst_case, random_case, [S]):
            assert sum(counts) == S
            assert sum(math.ceil(c / bm) for c in counts) <= moe.max_blocks(S, E, bm)


def test_plan_depends_on_shapes_only():
    a = moe.make_plan(2, 6, 256, 4096, 512)
    assert a == moe.make_plan(2, 6, 256, 4096, 512) and a.inline
    assert not moe.make_plan(16, 6, 256, 4096, 512).inline
    assert moe.make_plan(4096, 6, 256, 4096, 512).gemm1.block_m > moe.make_plan(256, 6, 256, 4096, 512).gemm1.block_m
    for cfg in moe.GEMM1_CONFIGS + moe.GEMM2_CONFIGS:
        assert cfg.block_k % 32 == 0 and cfg.block_m >= 16


def test_rejects_bad_shapes():
    kw = make_inputs(MoeCase(tokens=2))
    with pytest.raises(ValueError, match="weight shapes"):
        moe.mxfp4_moe_forward(**dict(kw, intermediate_size=32))


# ---------------------------------------------------------------- v2: repacked experts (moe.repack, moe.repacked_op)

V2_T8 = repacked_op.MmaConfig(8, 32, 64, 2, 1)
V2_T16 = repacked_op.MmaConfig(16, 32, 64, 2, 1)
V2_PLANS = {
    "inline_t8": repacked_op.PlanV2(True, V2_T8, V2_T8),
    "sorted_t8": repacked_op.PlanV2(False, V2_T8, V2_T8),
    "sorted_t16_g2_t8": repacked_op.PlanV2(False, V2_T16, V2_T8),
    "inline_splitk4": repacked_op.PlanV2(True, repacked_op.MmaConfig(8, 32, 32, 2, 1, split_k=4), V2_T8),
    "sorted_splitk2": repacked_op.PlanV2(False, repacked_op.MmaConfig(8, 32, 64, 2, 1, split_k=2), V2_T16),
}
V2_CASES = {
    "holes_clamp_scale": MoeCase(tokens=5, hole_frac=0.3, clamp_limit=0.4, routed_scaling_factor=2.5),
    # expert 0 on every one of 19 tokens: 3 chunks / blocks of 8 rows (and 2 of 16)
    "hot_expert": MoeCase(tokens=19, topk=3, routing="hot", clamp_limit=0.4),
    "dup_experts_top1": MoeCase(tokens=6, topk=1, routing="dup", routed_scaling_factor=0.7),
}


def _repacked(kw: dict) -> repack.RepackedExperts:
    return repack.repack_experts(kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"])


def _call_v2(kw: dict, plan=None) -> torch.Tensor:
    out = torch.full_like(kw["hidden_states"], float("nan"))
    o = repacked_op.run_repacked(kw["hidden_states"], _repacked(kw), kw["topk_ids"], kw["topk_weights"],
                           kw["routed_scaling_factor"], kw["clamp_limit"], plan=plan, out=out)
    assert o.data_ptr() == out.data_ptr()
    return o


def _v2_combinations():
    """Every (case, plan) pair the planner could produce: split-K with inline grouping only for
    tokens <= block_t (run_repacked refuses the rest, tested below)."""
    for name, case in sorted(V2_CASES.items()):
        for plan_name, plan in sorted(V2_PLANS.items()):
            if not (plan.inline and plan.gemm1.split_k > 1 and case.tokens > plan.gemm1.block_t):
                yield name, plan_name


@pytest.mark.parametrize("name,plan", list(_v2_combinations()))
def test_v2_matches_fp64_reference(name, plan):
    kw = make_inputs(V2_CASES[name])
    _assert_matches(kw, _call_v2(kw, V2_PLANS[plan]))


def test_v2_split_k_inline_at_one_token():
    kw = make_inputs(MoeCase(tokens=1, hole_frac=0.3, clamp_limit=0.4, routed_scaling_factor=2.5))
    _assert_matches(kw, _call_v2(kw, V2_PLANS["inline_splitk4"]))


def test_v2_e8m0_input_scales_and_planner_default():
    kw = make_inputs(MoeCase(tokens=2, hole_frac=0.2, scale_e8m0=True, clamp_limit=0.4, routed_scaling_factor=1.5))
    _assert_matches(kw, _call_v2(kw))  # the planner's own plan (inline, split-K GEMM1)


def test_v2_prefill_plan_runs_v1_on_the_fast_scales():
    """Past V2_MAX_ROWS_PER_EXPERT the planner hands back a v1 plan (`prefill_plan`); v1 then reads
    the PAIR_SPLIT words and the checked uint8 scales with the exponent-only decode."""
    assert isinstance(repacked_op.make_plan(4096, 6, 256, 4096, 512), moe.Plan)
    kw = make_inputs(MoeCase(tokens=7, topk=4, hole_frac=0.1, clamp_limit=0.4, routed_scaling_factor=2.0))
    _assert_matches(kw, _call_v2(kw, SORTED))
    _assert_matches(kw, _call_v2(kw, INLINE))


def test_v2_split_k_leaves_counters_zero_and_repeats_exactly():
    """The last split to arrive reduces and zeroes its counter: a second call (as a graph replay
    would) sees clean counters and gives the same bits."""
    from v4flash_kernels.kit.device import arrival_counters

    kw = make_inputs(MoeCase(tokens=1, clamp_limit=0.4, routed_scaling_factor=1.5))
    plan = V2_PLANS["inline_splitk4"]
    a = _call_v2(kw, plan)
    assert int(arrival_counters(a.device, 1).abs().sum()) == 0
    b = _call_v2(kw, plan)
    assert torch.equal(a, b)
    _assert_matches(kw, a)


def test_v2_refuses_split_k_inline_with_more_tokens_than_a_chunk():
    kw = make_inputs(MoeCase(tokens=9, topk=2))
    with pytest.raises(ValueError, match="split-K"):
        _call_v2(kw, V2_PLANS["inline_splitk4"])


def test_v2_plan_depends_on_shapes_only():
    p1 = repacked_op.make_plan(1, 6, 256, 4096, 512)
    assert p1 == repacked_op.make_plan(1, 6, 256, 4096, 512) and p1.inline and p1.gemm1.split_k > 1
    assert p1.gemm1.block_t >= 1  # M=1 fits one chunk: split-K is allowed
    p2 = repacked_op.make_plan(2, 6, 256, 4096, 512)
    assert p2.inline and p2.gemm1.split_k == 1
    p16 = repacked_op.make_plan(16, 6, 256, 4096, 512)
    assert not p16.inline and p16.gemm1.block_t == 8
    p256 = repacked_op.make_plan(256, 6, 256, 4096, 512)
    assert isinstance(p256, repacked_op.PlanV2) and p256.gemm1.block_t == 16
    assert isinstance(repacked_op.make_plan(1024, 6, 256, 4096, 512), moe.Plan)
    for cfg, _, _ in repacked_op.launchable():
        assert cfg.block_n % 16 == 0 and cfg.block_k % 32 == 0 and cfg.block_t in (8, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e8m0fnu])
def test_repack_accepts_powers_of_two_in_range(dtype):
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    b = torch.randint(kernel.FAST_MIN_BYTE, kernel.FAST_MAX_BYTE + 1, (3, 64, 4), generator=g, dtype=torch.uint8)
    s = b.view(torch.float8_e8m0fnu)
    s = s if dtype == torch.float8_e8m0fnu else s.to(torch.float32)
    assert repack.check_scales(s) is None
    assert torch.equal(repack.e8m0_bytes(s), b)


@pytest.mark.parametrize("bad,why", [
    (lambda s: s * 1.5, "not exact powers of two"),
    (lambda s: -s, "not exact powers of two"),
    (lambda s: s * 0, "not exact powers of two"),
    (lambda s: s * 2.0**-80, "not exact powers of two"),
    (lambda s: s * 2.0**80, "not exact powers of two"),
])
def test_repack_names_the_scales_it_refuses(bad, why):
    kw = make_inputs(MoeCase(tokens=1))
    s2 = kw["w2_scale"].clone()
    s2[3, 17, 1] = bad(s2[3, 17, 1])
    with pytest.raises(repack.ScaleError, match=why) as err:
        repack.repack_experts(kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], s2)
    msg = str(err.value)
    assert msg.startswith("w2_scale: 1 of ") and "[3, 17, 1]=" in msg


def test_repack_refuses_integer_scales_and_bad_shapes():
    kw = make_inputs(MoeCase(tokens=1))
    u8 = kw["w13_scale"].to(torch.uint8)
    with pytest.raises(repack.ScaleError, match="dtype torch.uint8"):
        repack.repack_experts(kw["w13_packed"], kw["w2_packed"], u8, kw["w2_scale"])
    ex = _repacked(kw)
    with pytest.raises(ValueError, match="RepackedExperts.s2"):
        repack.RepackedExperts(ex.w13, ex.w2, ex.s13, ex.s13)
    assert (ex.experts, ex.hidden, ex.inter) == (8, 128, 64)


def test_pair_split_layout_follows_its_definition():
    """Word nibble j of a repacked row holds weight k0 + 2j (j < 4) or k0 + 2(j - 4) + 1 (j >= 4) of the
    word's 8 weights; the loader's order has weight k0 + j in nibble j. Round trip is the identity."""
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    w = torch.randint(0, 256, (3, 5, 16), dtype=torch.uint8, generator=g)
    old_words = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    new = repack.pair_split(w.view(torch.int32))
    new_words = new.to(torch.int64) & 0xFFFFFFFF
    for j in range(8):
        k = 2 * j if j < 4 else 2 * (j - 4) + 1
        assert torch.equal((new_words >> (4 * j)) & 0xF, (old_words >> (4 * k)) & 0xF)
    assert torch.equal(repack.loader_order(new), w.view(torch.int32))
    ones = torch.ones(3, 5, 1)
    assert torch.equal(dequant(repack.loader_order(new).view(torch.uint8), ones), dequant(w, ones))


def test_repack_in_place_rewrites_the_layer_and_copy_does_not():
    kw = make_inputs(MoeCase(tokens=1))
    w13 = kw["w13_packed"].clone()
    ex = repack.repack_experts(kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"])
    assert torch.equal(kw["w13_packed"], w13) and ex.w13.data_ptr() != w13.data_ptr()
    ex2 = repack.repack_experts(w13, kw["w2_packed"].clone(), kw["w13_scale"], kw["w2_scale"], in_place=True)
    assert ex2.w13.data_ptr() == w13.data_ptr() and torch.equal(ex2.w13, ex.w13)
    assert not torch.equal(w13.view(torch.uint8), kw["w13_packed"].view(torch.uint8))
    bad = kw["w2_scale"] * 1.5
    w13b = kw["w13_packed"].clone()
    with pytest.raises(repack.ScaleError):
        repack.repack_experts(w13b, kw["w2_packed"].clone(), kw["w13_scale"], bad, in_place=True)
    assert torch.equal(w13b, kw["w13_packed"])  # refused: the weights are not touched


def test_v2_word_decode_slots_are_pinned():
    """The asm (GPU) and the interpreter branch place pair i's halves in the same join slots: the
    interpreter branch (tested above against fp64) hard-codes (0,4), (2,6), (1,5), (3,7)."""
    from v4flash_kernels.moe import pairsplit

    assert pairsplit.PAIR_SLOTS == ((0, 4), (2, 6), (1, 5), (3, 7))
    for i, (lo, hi) in enumerate(pairsplit.PAIR_SLOTS):
        assert f"mul.rn.bf16x2 t, ${8 + i}, $12; mov.b32 {{${lo}, ${hi}}}, t;" in pairsplit.WORD_ASM


# ---------------------------------------------------------------- prefill on repacked experts (v1 GEMM, NIBBLES=1)

# Prefill-like: 15-20 rows per expert on average over 8 experts, so every expert spans several
# 16-row blocks (and partial ones); small dims for the interpreter. GEMM1 with BLOCK_K 128 covers
# four scale groups per k-step (PF_G1_SMALL's), GEMM2 with BLOCK_K 32 one.
PF_CASES = {
    "rows20_holes_clamp_scale": MoeCase(tokens=40, topk=4, hole_frac=0.1, clamp_limit=0.4, routed_scaling_factor=2.0),
    "hot_e8m0_rows9": MoeCase(tokens=24, topk=3, routing="hot", scale_e8m0=True, clamp_limit=0.4),
}
PF_PLANS = {
    "mode0": moe.Plan(False, moe.GemmConfig(16, 16, 64, 4, 1), moe.GemmConfig(16, 32, 32, 4, 1)),
    "mode1": moe.Plan(False, moe.GemmConfig(16, 16, 64, 4, 1, mode=1), moe.GemmConfig(16, 32, 32, 4, 1, mode=1)),
    "mode1_k128_m32": moe.Plan(False, moe.GemmConfig(32, 16, 128, 4, 1, mode=1), moe.GemmConfig(32, 32, 64, 4, 1, mode=1)),
}


@pytest.mark.parametrize("plan", sorted(PF_PLANS))
@pytest.mark.parametrize("name", sorted(PF_CASES))
def test_prefill_on_pair_split_words_matches_fp64(name, plan):
    """v1's row-block GEMMs reading the repacked (in place, PAIR_SPLIT) words: W decoded into k
    order, contracted against the activation as loaded, in both operand orders."""
    kw = make_inputs(PF_CASES[name])
    _assert_matches(kw, _call_v2(kw, PF_PLANS[plan]))


@pytest.mark.parametrize("tokens", [40, 100])
def test_public_entry_runs_the_shipped_prefill_plan(tokens):
    """`moe_forward_repacked` (what the patched `apply` calls) at 30 and 75 rows per expert: the
    planner's own prefill plan with the shipped tiles (32-row mode 0; 128-row mode 1) vs fp64."""
    kw = make_inputs(MoeCase(tokens=tokens, hole_frac=0.05, clamp_limit=0.4, routed_scaling_factor=1.5))
    plan = repacked_op.make_plan(tokens, 6, 8, 128, 64)
    assert plan == repacked_op.prefill_plan(tokens, 6, 8, 128, 64)
    assert plan.gemm1 == (repacked_op.PF_G1_SMALL if tokens == 40 else repacked_op.PF_G1_LARGE)
    out = repacked_op.moe_forward_repacked(kw["hidden_states"], _repacked(kw), kw["topk_ids"], kw["topk_weights"],
                                     kw["routed_scaling_factor"], kw["clamp_limit"])
    _assert_matches(kw, out)


def test_prefill_on_pair_split_words_inline_grouping():
    kw = make_inputs(MoeCase(tokens=2, topk=4, hole_frac=0.2, routed_scaling_factor=1.5))
    _assert_matches(kw, _call_v2(kw, moe.Plan(True, PF_PLANS["mode1"].gemm1, PF_PLANS["mode1"].gemm2)))


def test_prefill_plan_is_launchable_on_pair_split_words():
    """Every plan the repacked path hands to v1's GEMM is one NIBBLES=1 accepts (tensor-core modes,
    no split-K) and one check_sm120 compiles (repacked_op.launchable_v1)."""
    compiled = set(repacked_op.launchable_v1())
    for m in (64, 256, 300, 512, 1024, 2048, 4096, 16384):
        p = repacked_op.make_plan(m, 6, 256, 4096, 512)
        if isinstance(p, moe.Plan):
            assert p == repacked_op.prefill_plan(m, 6, 256, 4096, 512) and not p.inline
            assert {(p.gemm1, True, False), (p.gemm2, False, False)} <= compiled
            for cfg in (p.gemm1, p.gemm2):
                assert cfg.mode <= 1 and cfg.split_k == 1 and cfg.block_k <= 128
    big, small = (repacked_op.prefill_plan(m, 6, 256, 4096, 512) for m in (4096, 1024))
    assert big.gemm1.block_m > small.gemm1.block_m


def test_pair_split_words_refuse_other_gemm_bodies():
    """NIBBLES=1 is only implemented for the dot bodies and the range-checked scales: anything else
    is refused before a launch, never computed on the wrong nibble order."""
    kw = make_inputs(MoeCase(tokens=4, topk=2))
    ex = _repacked(kw)
    args = (kw["hidden_states"], ex.w13, ex.w2, ex.s13, ex.s2, kw["topk_ids"], kw["topk_weights"], ex.inter)
    with pytest.raises(ValueError, match="nibbles=1"):
        moe.run(*args, plan=MODES["fma_rows2"], fast_scales=True, nibbles=1)
    with pytest.raises(ValueError, match="nibbles=1"):
        moe.run(*args, plan=MODES["split_k4_dot"], fast_scales=True, nibbles=1)
    with pytest.raises(ValueError, match="nibbles=1"):
        moe.run(kw["hidden_states"], ex.w13, ex.w2, kw["w13_scale"], kw["w2_scale"], kw["topk_ids"],
                kw["topk_weights"], ex.inter, plan=SORTED, nibbles=1)
    with pytest.raises(ValueError, match="nibbles must be"):
        moe.run(*args, plan=SORTED, fast_scales=True, nibbles=2)


def test_bench_sweep_candidates_and_tables():
    """The GPU bench's pure parts: every swept plan is one the kernels accept, the planner's own plan
    comes first, and both tables format a row (synthetic numbers, no GPU)."""
    import v4flash_bench.moe as bench

    for m in (1, 2, 16, 64, 256, 1024, 4096):
        plans = bench.v2_candidates(bench.Shape(4, m))
        first = next(iter(plans.values()))
        assert first == repacked_op.make_plan(m, 6, 256, 4096, 512)
        for p in plans.values():
            if isinstance(p, repacked_op.PlanV2):
                for cfg in (p.gemm1, p.gemm2):
                    assert cfg.block_n % 16 == 0
                    assert cfg.block_n >= 16 * cfg.num_warps and 4096 % cfg.block_k == 0
                assert p.gemm2.split_k == 1
                assert not (p.inline and p.gemm1.split_k > 1 and m > p.gemm1.block_t)
    v = {"ok": True, "rel_err": 3e-3, "nan": False, "us": 10.0, "note": "graph"}
    row = {"tp": 4, "tokens": 1, "routing": "random", "hole_frac": 0.0, "experts_touched": 6.0, "bytes": 2e7,
           "floor_h200_us": 4.6, "floor_rtx6000_us": 11.0, "plan_v2": "v2-inline/...",
           "variants": {"v1": dict(v, us=40.0), "v2": v, "upstream": dict(v, us=250.0)}}
    assert "4.00" in bench.format_table([row]) and "| **10.0** |" in bench.format_markdown([row])


def test_bench_prefill_candidates_and_verdict():
    """`bench --prefill`'s pure parts: the planner's plan first, every repacked candidate one the
    kernels accept (v1 plans on PAIR_SPLIT words: dot bodies, no split-K), the v2/v1 crossover
    covered from both sides, and the verdict compares the planner with v1 (synthetic numbers)."""
    import v4flash_bench.moe as bench

    for m in (256, 1024, 4096):
        plans = bench.prefill_candidates(bench.Shape(4, m))
        assert next(iter(plans.values())) == repacked_op.make_plan(m, 6, 256, 4096, 512)
        assert repacked_op.prefill_plan(m, 6, 256, 4096, 512) in plans.values()
        assert {c.mode for p in plans.values() if isinstance(p, moe.Plan) for c in (p.gemm1, p.gemm2)} == {0, 1}
        for p in plans.values():
            if isinstance(p, moe.Plan):
                assert not p.inline and all(c.split_k == 1 and c.block_k <= 128 for c in (p.gemm1, p.gemm2))
        assert any(isinstance(p, repacked_op.PlanV2) for p in plans.values()) == (m <= 1024)
        names = bench.prefill_variants(bench.Shape(4, m))
        assert list(names)[:2] == [bench.V1_BASELINE, bench.PLANNER] and bench.LOADER_FAST in names
        assert len(names) <= 16  # ~1 min for three sizes with compiles
    v = {"ok": True, "rel_err": 3e-3, "nan": False}
    row = {"tokens": 4096, "variants": {bench.V1_BASELINE: dict(v, us=2232.7), bench.PLANNER: dict(v, us=2000.0),
                                        "repacked: sorted/x": dict(v, us=1900.0),
                                        "repacked: sorted/y": dict(v, ok=False, us=10.0)}}
    line = bench.prefill_verdict(row)
    assert "planner 2000.0 us vs v1 2232.7 us (1.12x) OK" in line and line.endswith("1900.0 us: sorted/x")
    row["variants"][bench.PLANNER]["us"] = 2300.0
    assert "SLOWER" in bench.prefill_verdict(row)


def test_selfcheck_covers_the_repacked_path():
    """The moe switch's self-check runs every shape twice: the drop-in and the repacked layer's v2
    forward (what sglang_patch.apply calls), graph-replayed at the largest batch."""
    from v4flash_kernels.moe import selfcheck
    from v4flash_kernels.selfcheck.case import Target

    t = Target(device="cpu", batches=(1, 32), prefill_rows=8192, tp_size=4)
    m = {c.name: c for c in selfcheck.cases(t)}
    for base in ("decode M=1", "decode M=32", "prefill M=8192", "small M=5 holes+clamp"):
        assert base in m and f"{base} repacked (v2)" in m
    assert m["decode M=32 repacked (v2)"].graph and not m["decode M=1 repacked (v2)"].graph
    assert m["decode M=1 repacked (v2)"].ours is not m["decode M=1"].ours
