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
from v4flash_kernels.fp8_gemm.kernel import round_e4m3
from v4flash_kernels.fp8_gemm.reference import (
    FP8,
    excess_error,
    linear_ref,
    make_activation,
    make_quantized,
    make_weight,
    matmul_ref,
    quantize_activation_ref,
)

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
    from v4flash_kernels.fp8_gemm.bench import upstream_fp8_kernel

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


def test_fused_quant_codes_are_the_definition_bit_for_bit():
    """Selector weights (one 1.0 per row, block scales 1) make each output one code times its scale,
    exactly representable in fp32: any code or scale the fused quant got wrong shows."""
    m, k = 19, 384
    x = make_activation(m, k, _gen(3), dtype=torch.float32)
    perm = torch.randperm(k, generator=_gen(4))
    w = torch.zeros((k, k), dtype=torch.float32)
    w[torch.arange(k), perm] = 1.0
    w8, ws = w.to(FP8), torch.ones((k // 128, k // 128))
    qr, sr = quantize_activation_ref(x)
    want = (qr.float() * sr.repeat_interleave(128, -1))[:, perm]
    for cfg, split in ((op.DECODE, 3), (op.SMALL, 2), (op.MEDIUM, 1)):
        out = op.linear_2d(x, w8, ws, config=cfg, split=split)
        assert torch.equal(out, want), cfg.name


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
def test_every_config_with_and_without_split(cfg):
    m, n, k = {16: 5, 32: 20, 64: 40}.get(cfg.block_m, 70), 256, 640  # 5 K groups: uneven splits too
    x = make_activation(m, k, _gen(30))
    w, ws = make_weight(n, k, _gen(31))
    ref, mag = linear_ref(x, w, ws)
    splits = (1, 2, 5) if cfg.max_split > 1 else (1,)
    for split in splits:
        _assert_matches(op.linear_2d(x, w, ws, config=cfg, split=split), ref, mag, torch.bfloat16)


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
    x = make_activation(3, 1024, _gen(50))
    w, ws = make_weight(384, 1024, _gen(51))
    outs = [op.linear_2d(x, w, ws, config=op.DECODE, split=8) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert int(op.tickets(x.device, 1).abs().sum()) == 0


# ----------------------------------------------------------------------------- the GEMM entry


@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (3, 200, 200), (17, 128, 320), (64, 384, 384)])
def test_matmul_matches_reference_and_upstream(m, n, k, upstream):
    """K not a multiple of 128 (masked last group) is accepted by the GEMM, as upstream does."""
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
    from v4flash_kernels.fp8_gemm.bench import upstream_fp8_kernel, upstream_fp8_linear
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


def test_plan_is_shape_only_and_splits_are_never_empty():
    for m in (1, 4, 16, 17, 32, 33, 64, 65, 256, 1024, 8192):
        for n, k in ((1536, 4096), (8192, 1024), (4096, 2048), (1024, 4096), (4096, 512), (200, 200)):
            for sms in (132, 188):
                p = op.plan(m, n, k, sms)
                assert p == op.plan(m, n, k, sms)
                assert p.config in op.CONFIGS and 1 <= p.split <= max(1, p.config.max_split)
                groups = -(-k // 128)
                per = -(-groups // p.split)
                assert (p.split - 1) * per < groups  # the last split has work
                tiles = -(-m // p.config.block_m) * -(-n // p.config.block_n)
                if p.split > 1:
                    assert tiles * p.split <= p.config.ctas_per_sm * sms
    assert op.plan(1, 1536, 4096, 132).config.swap
    assert op.plan(1, 4096, 512, 132).config is op.DECODE_NARROW
    assert op.plan(8192, 8192, 1024, 132) == op.Plan(op.LARGE, 1)
    assert op.plan(1024, 1024, 4096, 132) == op.Plan(op.LARGE, 1)  # prefill: upstream's tiling, unsplit


def test_launchable_covers_the_planned_binaries():
    kinds = set(op.launchable())
    for m in (1, 16, 17, 64, 65, 256, 8192):
        for n, k in ((1536, 4096), (4096, 512)):
            p = op.plan(m, n, k, 132)
            a = "bf16" if p.config.fuse_quant else "fp8"
            assert op.Binary(p.config, a, "bf16", p.split > 1) in kinds
            assert op.Binary(p.config, "fp8", "bf16", p.split > 1) in kinds  # the GEMM entry (pre-quantized A)
