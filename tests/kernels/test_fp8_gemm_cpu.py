"""CPU tests of the block-FP8 GEMM / linear under TRITON_INTERPRET=1 (small shapes).

Every result is checked against the fp64 reference written from the format (`fp8_gemm.reference`),
and the GEMM against upstream's `w8a8_block_fp8_matmul_triton`, extracted verbatim from the pinned
sglang wheel at test time, on the same operands in the same run. The linear's activation quant is
checked bit for bit against its definition, both standalone and inside the fused GEMM.
"""

from __future__ import annotations

import inspect
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from v4flash_kernels.fp8_gemm import op
from v4flash_kernels.fp8_gemm.reference import (
    linear_ref,
    make_activation,
    make_quantized,
    make_weight,
    matmul_ref,
)
from v4flash_kernels.kit.compare import excess_error
from v4flash_kernels.kit.e4m3 import round_e4m3
from v4flash_kernels.kit.fp8 import FP8, quantize_activation_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)
# Output rounding bound per dtype (the interpreter's fp32 -> bf16/fp16 cast truncates: < 1 ulp) and
# the fp32 accumulation bound relative to the sum of |terms|.
RTOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}
ATOL_MAG = 2.0 ** -16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_matches(out, ref, mag, dtype):
    ex = excess_error(out, ref, mag, RTOL[dtype], ATOL_MAG)
    assert ex <= 1.0, f"error {ex:.3g}x the bound"


@triton.jit
def _round_kernel(X, Q, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(X + o, mask=o < n)
    tl.store(Q + o, round_e4m3(v).to(tl.float8e4nv), mask=o < n)


@pytest.fixture(scope="module")
def upstream():
    from v4flash_kernels.fp8_gemm.upstream import upstream_fp8_kernel

    return upstream_fp8_kernel()


# ----------------------------------------------------------------------------- the activation quant


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activation_quant_is_the_definition_bit_for_bit(dtype):
    x = make_activation(37, 512, _gen(1), dtype=dtype)
    x[5, 128:256] = torch.linspace(-3, 3, 128).to(dtype)  # a group with exact zero and ties
    x[7, :128] = -0.0  # an all-(-0) group: amax floor, codes keep the sign of zero
    q, s = op.quantize_activation(x)
    qr, sr = quantize_activation_ref(x)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s, sr)


def test_e4m3_rounding_matches_the_rne_cast():
    """`round_e4m3` against torch's round-to-nearest-even e4m3 cast on every binade and the subnormals."""
    g = _gen(2)
    grid_vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid_vals = grid_vals[torch.isfinite(grid_vals)]
    mids = (grid_vals.sort().values[1:] + grid_vals.sort().values[:-1]) / 2  # exact ties
    x = torch.cat([torch.rand(20000, generator=g) * 896 - 448, torch.randn(20000, generator=g) * 1e-2,
                   grid_vals, mids, torch.tensor([-0.0, 0.0, 448.0, -448.0, 2.0 ** -10, -(2.0 ** -10)])])
    x = x.clamp(-448, 448)
    q = torch.empty(x.shape, dtype=FP8)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, q, x.numel(), BLOCK=1024)
    assert torch.equal(q.view(torch.uint8), x.to(FP8).view(torch.uint8))


def _selector(k: int, seed: int):
    """A permutation weight (one 1.0 per row, block scales 1): each output is one code times its scale,
    exactly representable in fp32, so any code or scale the quant got wrong shows."""
    perm = torch.randperm(k, generator=_gen(seed))
    w = torch.zeros((k, k), dtype=torch.float32)
    w[torch.arange(k), perm] = 1.0
    return perm, w.to(FP8), torch.ones((k // 128, k // 128))


@pytest.mark.parametrize("cfg,m,split", [
    (op.DECODE, 19, 3),  # fused in the swap-AB tile, ticket
    (op.DECODE, 5, 3),
    (op.MID, 19, 2),  # the separate quant kernel, then the 64-row tile
    (op.MID_N64, 3, 1),
], ids=lambda v: getattr(v, "name", str(v)))
def test_fused_and_separate_quant_codes_are_the_definition_bit_for_bit(cfg, m, split):
    k = 384
    x = make_activation(m, k, _gen(3), dtype=torch.float32)
    perm, w8, ws = _selector(k, 4)
    qr, sr = quantize_activation_ref(x)
    want = (qr.float() * sr.repeat_interleave(128, -1))[:, perm]
    out = op.linear_2d(x, w8, ws, config=cfg, split=split)
    assert torch.equal(out, want), cfg.name


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_quant_codes_are_the_definition_bit_for_bit(m):
    """The GEMV quantizes its rows itself (1-row and multi-row paths): the same bits."""
    k = 512
    x = make_activation(m, k, _gen(5 + m), dtype=torch.float32)
    perm, w8, ws = _selector(k, 6)
    qr, sr = quantize_activation_ref(x)
    want = (qr.float() * sr.repeat_interleave(128, -1))[:, perm]
    out = op.linear_2d(x, w8, ws, config=op.GemvConfig(16, 4))
    assert torch.equal(out, want)


# ----------------------------------------------------------------------------- the linear


LINEAR_SHAPES = [(256, 512), (200, 384)]  # N x K: 128-multiples, and N not (the last block partial)


@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("n,k", LINEAR_SHAPES)
def test_linear_matches_reference_and_upstream_gemm(m, n, k, upstream):
    x = make_activation(m, k, _gen(10 + m))
    w, ws = make_weight(n, k, _gen(20 + n))
    ref, mag = linear_ref(x, w, ws)
    out = op.w8a8_block_fp8_linear(x, w, [128, 128], ws)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _assert_matches(out, ref, mag, torch.bfloat16)
    # Upstream's GEMM on the definition's quantized activation: the same function to rounding.
    qr, sr = quantize_activation_ref(x)
    up = upstream.w8a8_block_fp8_matmul_triton(qr, w, sr, ws, [128, 128], output_dtype=torch.bfloat16)
    _assert_matches(up, ref, mag, torch.bfloat16)
    assert (out.float() - up.float()).abs().max() <= 2 * RTOL[torch.bfloat16] * up.float().abs().max()


@pytest.mark.parametrize("cfg", op.CONFIGS, ids=lambda c: c.name)
def test_every_config_and_fixup(cfg):
    """Unsplit, ticket (2 and 3 splits: the unrolled loads masked past the split count) and reduce
    (10 splits) on every tile; 10 K groups, so 3 splits are uneven (4, 4, 2)."""
    m, n, k = {16: 5}.get(cfg.block_m, 70), 200, 1280
    x = make_activation(m, k, _gen(30))
    w, ws = make_weight(n, k, _gen(31))
    ref, mag = linear_ref(x, w, ws)
    seen = set()
    for split in (1, 2, 3, 10):
        seen.add(op.fixup_for(cfg, split))
        _assert_matches(op.linear_2d(x, w, ws, config=cfg, split=split), ref, mag, torch.bfloat16)
    assert seen == {"whole", "ticket", "reduce"}


GEMV_CONFIGS = sorted({b.config for b in op.launchable_gemv()}, key=lambda c: c.name)


@pytest.mark.parametrize("cfg", GEMV_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_every_gemv_config(cfg, m):
    """N = 200: the last program's weight rows wrap (never stored); 1-4 rows (padded to 1, 2, 4)."""
    x = make_activation(m, 512, _gen(32 + m))
    w, ws = make_weight(200, 512, _gen(33))
    ref, mag = linear_ref(x, w, ws)
    _assert_matches(op.linear_2d(x, w, ws, config=cfg), ref, mag, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_linear_dtypes_bias_and_leading_dims(dtype):
    x = make_activation(6, 256, _gen(40), dtype=dtype).view(2, 3, 256)
    w, ws = make_weight(128, 256, _gen(41))
    bias = torch.randn(128, generator=_gen(42)).to(dtype)
    out = op.w8a8_block_fp8_linear(x, w, [128, 128], ws, None, bias)
    assert out.shape == (2, 3, 128) and out.dtype == dtype
    ref, mag = linear_ref(x.view(6, 256), w, ws, bias)
    pre, _ = linear_ref(x.view(6, 256), w, ws)
    # the bias is added to the rounded product (upstream's `output += bias`): two roundings, the
    # first relative to the product (which the bias may cancel)
    bound = RTOL[dtype] * (pre.abs() + ref.abs()) + ATOL_MAG * mag
    assert ((out.view(6, 128).double() - ref).abs() <= bound).all()


def test_split_is_deterministic_and_leaves_tickets_at_zero():
    x = make_activation(3, 1280, _gen(50))
    w, ws = make_weight(384, 1280, _gen(51))
    for split in (8, 10):  # ticket, reduce
        outs = [op.linear_2d(x, w, ws, config=op.DECODE, split=split) for _ in range(3)]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert int(op.tickets(x.device, 1).abs().sum()) == 0


# ----------------------------------------------------------------------------- the GEMM entry


@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (3, 200, 200), (17, 128, 320), (64, 384, 384), (33, 256, 1536)])
def test_matmul_matches_reference_and_upstream(m, n, k, upstream, monkeypatch):
    """K not a multiple of 128 (masked last group) is accepted by the GEMM, as upstream does; with the
    H200's SM count the last case splits K and sums through the reduce launch."""
    monkeypatch.setattr(op, "num_sms", lambda device: 132)
    a, a_s = make_quantized(m, k, _gen(60 + m))
    w, ws = make_weight(n, k, _gen(61))
    ref, mag = matmul_ref(a, w, a_s, ws)
    for dtype in (torch.bfloat16, torch.float32):
        out = op.w8a8_block_fp8_matmul(a, w, a_s, ws, [128, 128], output_dtype=dtype)
        up = upstream.w8a8_block_fp8_matmul_triton(a, w, a_s, ws, [128, 128], output_dtype=dtype)
        assert out.dtype == up.dtype == dtype and out.shape == up.shape == (m, n)
        _assert_matches(out, ref, mag, dtype)
        _assert_matches(up, ref, mag, dtype)


def test_matmul_column_major_scales_3d_and_default_dtype(upstream):
    a, a_s = make_quantized(6, 256, _gen(70))
    a_cm = a_s.t().contiguous().t()  # column-major As, as SGLang's quant can produce
    a3, s3 = a.view(2, 3, 256), a_cm.view(2, 3, 2)
    w, ws = make_weight(256, 256, _gen(71))
    out = op.w8a8_block_fp8_matmul(a3, w, s3, ws, [128, 128])
    up = upstream.w8a8_block_fp8_matmul_triton(a3, w, s3, ws, [128, 128])
    assert out.dtype == up.dtype == torch.float16 and out.shape == up.shape == (2, 3, 256)
    ref, mag = matmul_ref(a, w, a_s, ws)
    _assert_matches(out.view(6, 256), ref, mag, torch.float16)
    _assert_matches(up.view(6, 256), ref, mag, torch.float16)


# ----------------------------------------------------------------------------- contract and fallbacks


def test_signatures_equal_upstreams():
    from v4flash_kernels.fp8_gemm.upstream import upstream_fp8_kernel, upstream_fp8_linear
    from v4flash_kernels.hook.hook import signature_mismatch

    assert signature_mismatch(upstream_fp8_linear().triton_w8a8_block_fp8_linear, op.w8a8_block_fp8_linear) is None
    assert signature_mismatch(upstream_fp8_kernel().w8a8_block_fp8_matmul_triton, op.w8a8_block_fp8_matmul) is None
    assert list(inspect.signature(op.w8a8_block_fp8_linear).parameters) == [
        "input", "weight", "block_size", "weight_scale", "input_scale", "bias"]


@pytest.fixture()
def fake_upstream(monkeypatch):
    """Upstream modules holding recording stand-ins under the names the hook keeps upstream's at."""
    from v4flash_kernels.hook.hook import upstream_keep_attr
    from v4flash_kernels.hook.patches import FP8_GEMM

    calls = []
    lin = SimpleNamespace(**{upstream_keep_attr(FP8_GEMM): lambda *a: calls.append(("linear", a)) or "up",
                             FP8_GEMM.target_attr: op.w8a8_block_fp8_linear})  # patched: the module holds ours
    ker = SimpleNamespace(w8a8_block_fp8_matmul_triton=lambda *a: calls.append(("matmul", a)) or "up")
    monkeypatch.setitem(sys.modules, op.FP8_UTILS, lin)
    monkeypatch.setitem(sys.modules, op.FP8_KERNEL, ker)
    return calls


def test_variants_not_computed_here_go_to_upstream(fake_upstream):
    x = make_activation(2, 256, _gen(80))
    w, ws = make_weight(128, 256, _gen(81))
    cases = {
        "input_scale": (x, w, [128, 128], ws, torch.ones(2, 2)),
        "block": (x, w, [64, 128], ws),
        "k_not_128": (make_activation(2, 200, _gen(82)), make_weight(128, 200, _gen(83))[0], [128, 128],
                      torch.ones(1, 2)),
        "ue8m0_scales": (x, w, [128, 128], torch.ones((1, 1), dtype=torch.int32)),
        "strided_input": (make_activation(2, 512, _gen(84))[:, ::2], w, [128, 128], ws),
        "empty": (x[:0], w, [128, 128], ws),
        "int8_input": (x.to(torch.int8), w, [128, 128], ws),
        "e5m2_weight": (x, w.float().to(torch.float8_e5m2), [128, 128], ws),
    }
    for name, args in cases.items():
        fake_upstream.clear()
        assert op.w8a8_block_fp8_linear(*args) == "up", name
        assert len(fake_upstream) == 1 and fake_upstream[0][0] == "linear", name
        assert len(fake_upstream[0][1]) == 6  # upstream gets every argument, bias included
    a, a_s = make_quantized(2, 256, _gen(85))
    for name, args in {"ue8m0_as": (a, w, torch.ones((2, 1), dtype=torch.int32), ws, [128, 128]),
                       "fp64_out": (a, w, a_s, ws, [128, 128], torch.float64),
                       "bf16_a": (a.float().bfloat16(), w, a_s, ws, [128, 128])}.items():
        fake_upstream.clear()
        assert op.w8a8_block_fp8_matmul(*args) == "up", name
        assert fake_upstream[0][0] == "matmul", name


def test_without_upstream_loaded_an_unsupported_call_raises(monkeypatch):
    monkeypatch.delitem(sys.modules, op.FP8_UTILS, raising=False)
    x = make_activation(2, 256, _gen(90))
    w, ws = make_weight(128, 256, _gen(91))
    with pytest.raises(NotImplementedError, match="input_scale"):
        op.w8a8_block_fp8_linear(x, w, [128, 128], ws, torch.ones(2, 2))
    # a module that holds only ours (upstream's not kept) must not send the call back to ours
    monkeypatch.setitem(sys.modules, op.FP8_UTILS, SimpleNamespace(triton_w8a8_block_fp8_linear=op.w8a8_block_fp8_linear))
    with pytest.raises(NotImplementedError, match="not loaded"):
        op.w8a8_block_fp8_linear(x, w, [128, 128], ws, torch.ones(2, 2))


# ----------------------------------------------------------------------------- the planner


DSV4 = {"wqkv_a": (1536, 4096), "wq_b": (8192, 1024), "wo_b": (4096, 2048), "shared_gate_up": (1024, 4096),
        "shared_down": (4096, 512)}
OTHER = [(4096, 4096), (7168, 2048), (200, 200), (256, 384), (576, 7168), (128, 8192)]


def test_plan_is_shape_only_and_splits_are_never_empty():
    for m in (1, 2, 3, 4, 5, 16, 17, 32, 33, 64, 65, 256, 257, 1024, 8192):
        for n, k in [*DSV4.values(), *OTHER, (200, 320)]:
            for sms in (132, 188):
                for quantized in (False, True):
                    p = op.plan(m, n, k, sms, quantized=quantized)
                    assert p == op.plan(m, n, k, sms, quantized=quantized)
                    if isinstance(p.config, op.GemvConfig):
                        assert not quantized and op.gemv_ok(p.config, m, k) and p.split == 1
                        continue
                    assert p.config in op.CONFIGS and 1 <= p.split <= max(1, p.config.max_split)
                    if k % 128:
                        assert p.config in op.RAGGED_CONFIGS
                    groups = -(-k // 128)
                    per = -(-groups // p.split)
                    assert (p.split - 1) * per < groups  # the last split has work
                    tiles = -(-m // p.config.block_m) * -(-n // p.config.block_n)
                    if p.split > 1:
                        assert m <= op.SPLIT_MAX_M and tiles * p.split <= p.config.ctas_per_sm * sms
                    if m > op.SPLIT_MAX_M and k % 128 == 0:
                        assert p == op.Plan(op.LARGE, 1)  # prefill: upstream's tiling, unsplit


def _names(n, k, ms, sms=132, quantized=False):
    return [op.plan(m, n, k, sms, quantized=quantized).name for m in ms]


def test_plan_picks_the_measured_winners():
    """The shipped table at the H200's 132 SMs: the sweep's winners (names as the sweep prints them)."""
    ms = (1, 2, 4, 16, 17, 64)
    d16, m128, m64 = "dot_m16_n128_w4_s2_swap_fq", "dot_m64_n128_w4_s3_sepq_g32", "dot_m64_n64_w4_s3_sepq"
    assert _names(*DSV4["wqkv_a"], ms) == ["gemv_n4_K_w4"] + [f"{d16}_reducec2/split16"] * 3 + [
        f"{m128}_reducec2/split16"] * 2
    assert _names(*DSV4["wq_b"], ms) == ["gemv_n16_K_w4"] + [f"{d16}_ticketc2/split4"] * 3 + [f"{m128}_whole"] * 2
    assert _names(*DSV4["wo_b"], ms) == ["gemv_n8_K_w4"] + [f"{d16}_ticketc2/split8"] * 3 + [
        f"{m64}_ticketc2/split4"] * 2
    assert _names(*DSV4["shared_gate_up"], ms) == ["gemv_n8_K_w8"] * 3 + [f"{d16}_reducec2/split32"] + [
        f"{m128}_reducec2/split32"] * 2
    assert _names(*DSV4["shared_down"], ms) == ["gemv_n16_K_w4"] + [f"{d16}_ticketc2/split4"] * 3 + [
        f"{m128}_whole"] * 2
    for n, k in DSV4.values():
        assert _names(n, k, (257, 1024, 8192)) == [f"{m128}_whole"] * 3  # prefill unchanged
        assert _names(n, k, (1,), quantized=True) == _names(n, k, (4,), quantized=True)  # GEMM entry: no GEMV


def test_generic_rule_for_unmeasured_shapes():
    assert op.plan(1, 4096, 4096, 132).config == op.GemvConfig(4, 4)  # 16 KB weight tiles
    assert op.plan(1, 3000, 512, 132).config == op.GemvConfig(32, 4)
    assert op.plan(2, 4096, 4096, 132).config is op.DECODE  # the GEMV only at one row
    for k in (256, 384, 8192, 7168):  # outside the measured K range, or not a power of 2
        assert op.plan(1, 4096, k, 132).config is op.DECODE
    assert op.plan(40, 4096, 1024, 132).config is op.LARGE  # short K: unsplit
    assert op.plan(40, 4096, 4096, 132).config is op.MID
    assert op.plan(40, 200, 320, 132, quantized=True).config is op.MID_N64  # ragged K


def test_fixup_bound():
    assert [op.fixup_for(op.DECODE, s) for s in (1, 2, 8, 9, 64)] == ["whole", "ticket", "ticket", "reduce", "reduce"]
    assert [op.fixup_for(op.MID, s) for s in (1, 2, 3)] == ["whole", "ticket", "reduce"]
    assert [op.fixup_for(op.MID_N64, s) for s in (4, 5)] == ["ticket", "reduce"]


def test_launchable_covers_the_planned_binaries():
    gemm = {b.name for b in op.launchable()}
    gemv = {b.name for b in op.launchable_gemv()}
    sps = set(op.launchable_reduce())
    for m in (1, 2, 3, 4, 5, 16, 17, 33, 64, 65, 128, 256, 257, 8192):
        for n, k in [*DSV4.values(), *OTHER, (200, 320)]:
            for sms in (132, 170, 188):
                for quantized in (False, True):
                    if k % 128 and not quantized:
                        continue  # the linear hands such K to upstream
                    p = op.plan(m, n, k, sms, quantized=quantized)
                    if isinstance(p.config, op.GemvConfig):
                        for x in ("bf16", "fp32"):
                            assert op.GemvBinary(p.config, k, op.pow2(m), x, x).name in gemv
                        continue
                    sp = op.pow2(p.split) if p.fixup == "ticket" else 1
                    kinds = [("fp8", "bf16"), ("fp8", "fp32")] if quantized or not p.config.fuse_quant else [
                        ("bf16", "bf16"), ("fp32", "fp32")]
                    for a, c in kinds:
                        if a == "fp8" and c == "bf16" and (k % 128 or p.config.fuse_quant):
                            c = "fp32"  # the GEMM entry only: the widest output stands for the others
                        want = op.Binary(p.config, a, c, p.fixup, sp, k % 128 == 0)
                        assert want.name in gemm, want.name
                    if p.fixup == "reduce":
                        assert op.pow2(p.split) in sps


# ----------------------------------------------------------------------------- every plan entry, real shapes


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape,m", [(s, m) for s in DSV4 for m in (1, 16, 40)] + [("shared_gate_up", 2),
                                                                                   ("shared_gate_up", 3)])
def test_dsv4_plan_entries_match_reference_and_upstream(shape, m, upstream, monkeypatch):
    """Each DeepSeek-V4 shape through the plan the H200 runs (132 SMs: its splits and fix-ups), on the
    interpreter: the GEMV (1 row; 2 and 3 rows for gate_up), the decode tile, the 64-row tiles, against
    fp64 and upstream's GEMM (~15 s each)."""
    monkeypatch.setattr(op, "num_sms", lambda device: 132)
    n, k = DSV4[shape]
    x = make_activation(m, k, _gen(100 + m))
    w, ws = make_weight(n, k, _gen(101))
    ref, mag = linear_ref(x, w, ws)
    out = op.w8a8_block_fp8_linear(x, w, [128, 128], ws)
    _assert_matches(out, ref, mag, torch.bfloat16)
    qr, sr = quantize_activation_ref(x)
    up = upstream.w8a8_block_fp8_matmul_triton(qr, w, sr, ws, [128, 128], output_dtype=torch.bfloat16)
    _assert_matches(up, ref, mag, torch.bfloat16)
    assert (out.float() - up.float()).abs().max() <= 2 * RTOL[torch.bfloat16] * up.float().abs().max()
