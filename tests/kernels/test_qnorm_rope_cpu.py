"""CPU tests of the fused q path (wq_b's block-FP8 GEMM + per-head RMSNorm + RoPE) under TRITON_INTERPRET=1.

Every fused result is held to `reference.error_bound` around the fp64 reference written from the
definitions (block-FP8 dequant of the definition's quantized activation, RMSNorm, RoPE): fp32
accumulation of the fp8 products (2^-10 of the |terms|) and a bf16 rounding at each of upstream's three
points, one whole bf16 ulp here because the interpreter truncates its fp32 -> bf16 casts (and IEEE fp32
accumulation, 2^-16 of the |terms|, instead of the tensor cores' 2^-10). The bound is
shown to catch the mistakes a q path can make (a conjugate or half-split rotation, RoPE on the wrong
dims, a few ulps off). The drop-in is exercised on a layer as SGLang builds it (its wq_b dispatching
to our block-FP8 linear): fused where it computes the call exactly, upstream's method (a recording
stand-in under the name the hook keeps it at) for everything else, each refusal with its reason.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from v4flash_kernels.fp8_gemm.op import w8a8_block_fp8_linear
from v4flash_kernels.hook.hook import upstream_keep_attr
from v4flash_kernels.hook.patches import QNORM_ROPE
from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.qnorm_rope import op
from v4flash_kernels.qnorm_rope import reference as R
from v4flash_kernels.qnorm_rope import upstream as U

pytestmark = pytest.mark.skipif(
    __import__("os").environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)
K = op.FUSED_K
EPS = 1e-6
TABLE = 4096


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(m: int, heads: int, seed: int, pos_dtype=torch.int64):
    g = _gen(seed)
    x = R.make_activation(m, K, g)
    w, ws = R.make_weight(heads * 512, K, g)
    return x, w, ws, R.make_freqs_cis(TABLE), R.make_positions(m, TABLE, g, dtype=pos_dtype)


def _check(out, x, w, ws, heads, freqs, pos) -> float:
    ref = R.qnorm_rope_ref(x, w, ws, heads, EPS, freqs, pos)
    bound = R.error_bound(x, w, ws, heads, EPS, freqs, pos, R.BF16_TRUNC, R.ACC_IEEE)
    assert out.shape == (x.shape[0], heads, 512) and out.dtype == torch.bfloat16
    ex = R.excess(out, ref, bound)
    assert ex <= 1.0, ex
    return ex


def _layer(w, ws, heads, freqs, **over):
    """An MQALayer's facts as SGLang builds it with the fp8_gemm patch active (override any of them)."""
    quant = SimpleNamespace(w8a8_block_fp8_linear=over.pop("linear", w8a8_block_fp8_linear), block_quant=True,
                            use_marlin=over.pop("use_marlin", False), use_mxfp8=False,
                            quant_config=SimpleNamespace(weight_block_size=over.pop("block", [128, 128])))
    wq_b = SimpleNamespace(quant_method=quant, weight=w, weight_scale_inv=ws, bias=over.pop("bias", None),
                           gather_output=over.pop("gather_output", False))
    return SimpleNamespace(wq_b=wq_b, head_dim=over.pop("head_dim", 512), qk_rope_head_dim=over.pop("rope", 64),
                           n_local_heads=heads, eps=EPS, freqs_cis=freqs)


@pytest.fixture()
def upstream_method(monkeypatch):
    """`deepseek_v4` as the hook leaves it: upstream's `_compute_q_b` kept next to ours (a recorder here)."""
    calls = []
    mod = SimpleNamespace(**{upstream_keep_attr(QNORM_ROPE): lambda *a: calls.append(a) or "upstream"})
    monkeypatch.setitem(sys.modules, QNORM_ROPE.target_module, mod)
    return calls


# ----------------------------------------------------------------------------- the fused kernel


@pytest.mark.parametrize("cfg", sorted({c.block_k: c for c in op.launchable()}.values(), key=lambda c: c.block_k),
                         ids=lambda c: c.name)
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_fused_matches_fp64_within_the_derived_bound(m, cfg):
    x, w, ws, freqs, pos = _inputs(m, 2, 10 + m)
    out = op.qnorm_rope(x, w, ws, 2, EPS, freqs, pos, config=cfg)
    _check(out, x, w, ws, 2, freqs, pos)
    assert out.is_contiguous()
    # three bf16 roundings (truncations here) bound the result to ~3 ulps: 4 % off is out
    ref = R.qnorm_rope_ref(x, w, ws, 2, EPS, freqs, pos)
    bound = R.error_bound(x, w, ws, 2, EPS, freqs, pos, R.BF16_TRUNC, R.ACC_IEEE)
    assert R.excess((out.double() * 1.04).bfloat16(), ref, bound) > 1.0


def test_strided_q_out_int32_positions_and_only_this_ranks_heads_written():
    """At attention-TP > 1 q_out is this rank's slice of the padded 64-head q (here heads 2..4 of 6)."""
    m, heads = 4, 2
    x, w, ws, freqs, pos = _inputs(m, heads, 20, pos_dtype=torch.int32)
    padded = torch.full((m, 6, 512), float("nan"), dtype=torch.bfloat16)
    q_out = padded[:, 2:4]
    assert not q_out.is_contiguous()
    got = op.qnorm_rope(x, w, ws, heads, EPS, freqs, pos, q_out)
    assert got is q_out
    _check(q_out, x, w, ws, heads, freqs, pos)
    assert torch.isnan(padded[:, :2].float()).all() and torch.isnan(padded[:, 4:].float()).all()


def test_int32_and_int64_positions_give_the_same_result():
    x, w, ws, freqs, pos = _inputs(3, 1, 21)
    a = op.qnorm_rope(x, w, ws, 1, EPS, freqs, pos)
    b = op.qnorm_rope(x, w, ws, 1, EPS, freqs, pos.to(torch.int32))
    assert torch.equal(a, b)


def test_fused_and_the_unfused_composition_agree():
    """The composition the fusion replaces (our fp8 linear, then the torch statement of upstream's JIT
    norm + RoPE) is held to the same bound; the two differ only where a bf16 rounding went the other way."""
    m, heads = 5, 2
    x, w, ws, freqs, pos = _inputs(m, heads, 22)
    fused = op.qnorm_rope(x, w, ws, heads, EPS, freqs, pos)
    unfused = U.unfused(x, w, ws, heads, EPS, freqs, pos)
    _check(fused, x, w, ws, heads, freqs, pos)
    _check(unfused, x, w, ws, heads, freqs, pos)
    assert rel_err(fused, unfused) <= 2.0 ** -7


def test_torch_statement_of_upstreams_norm_rope_is_the_definition_in_fp32():
    """`upstream.q_norm_rope` (the stand-in for the JIT kernel) on a bf16 q vs fp64 of the same q: within a
    bf16 rounding (to nearest: torch) of the normalised value, carried through the rotation, plus one of
    the rotated pair."""
    g = _gen(30)
    q = (torch.randn((3, 4, 512), generator=g) * 3).to(torch.bfloat16)
    freqs, pos = R.make_freqs_cis(TABLE), R.make_positions(3, TABLE, g)
    out = torch.empty_like(q)
    U.q_norm_rope(q, out, EPS, freqs, pos)
    qd = q.double()
    y = qd / torch.sqrt((qd * qd).mean(-1, keepdim=True) + EPS)
    want = R._rope(y, freqs[pos])
    f = freqs[pos]
    c, s = f.real.double().abs()[:, None, :], f.imag.double().abs()[:, None, :]
    terms = y.abs().clone()
    re, im = y[..., R.NOPE::2].abs(), y[..., R.NOPE + 1::2].abs()
    terms[..., R.NOPE::2], terms[..., R.NOPE + 1::2] = re * c + im * s, re * s + im * c
    tol = (2.0 ** -8 + 2.0 ** -20) * terms + 2.0 ** -8 * want.abs()
    assert ((out.double() - want).abs() <= tol).all()
    assert not ((out.double() - want).abs() <= 0.25 * tol).all()  # the roundings are there: the bound is not slack


def test_the_bound_catches_a_wrong_q_path():
    """Rotations upstream does not do, RoPE on other dims, or 8 bf16 ulps off one value: all out of bounds."""
    m, heads = 3, 2
    x, w, ws, freqs, pos = _inputs(m, heads, 40)
    ref = R.qnorm_rope_ref(x, w, ws, heads, EPS, freqs, pos)
    bound = R.error_bound(x, w, ws, heads, EPS, freqs, pos, R.BF16_TRUNC, R.ACC_IEEE)
    out = op.qnorm_rope(x, w, ws, heads, EPS, freqs, pos)
    assert R.excess(out, ref, bound) <= 1.0
    q, _ = R.linear_ref(x, w, ws)
    q = q.view(m, heads, 512)
    y = q / torch.sqrt((q * q).mean(-1, keepdim=True) + EPS)
    f = freqs[pos.long()]
    wrong = {
        "conjugate": R._rope(y, f.conj()),
        "dims 384-447": R._rope(y.roll(64, -1), f).roll(-64, -1),
        "half split (neox)": _neox(y, f),
        "no rope": y,
    }
    for name, bad in wrong.items():
        assert R.excess(bad.bfloat16(), ref, bound) > 1.0, name
    off = out.clone()
    v = off[1, 1, 500].float()
    off[1, 1, 500] = (v + 8 * abs(v) * 2.0 ** -7).bfloat16()
    assert R.excess(off, ref, bound) > 1.0


def _neox(y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    out = y.clone()
    a, b = y[..., R.NOPE:R.NOPE + 32], y[..., R.NOPE + 32:]
    c, s = f.real.double()[:, None, :], f.imag.double()[:, None, :]
    out[..., R.NOPE:R.NOPE + 32] = a * c - b * s
    out[..., R.NOPE + 32:] = a * s + b * c
    return out


# ----------------------------------------------------------------------------- the drop-in


def test_drop_in_fuses_a_layer_whose_wq_b_is_our_linear(upstream_method):
    x, w, ws, freqs, pos = _inputs(3, 2, 50)
    layer = _layer(w, ws, 2, freqs)
    before = op.status_detail()["fused_calls"]
    out = op.compute_q_b(layer, x, pos)
    assert upstream_method == []
    _check(out, x, w, ws, 2, freqs, pos)
    assert op.status_detail()["fused_calls"] == before + 1
    padded = torch.full((3, 4, 512), float("nan"), dtype=torch.bfloat16)
    assert op.compute_q_b(layer, x, pos, padded[:, 2:]) is not None and upstream_method == []
    _check(padded[:, 2:], x, w, ws, 2, freqs, pos)


def _refusals():
    """(name, layer, q, positions, q_out, reason fragment): every call the fused path must leave to upstream."""
    x, w, ws, freqs, pos = _inputs(3, 2, 60)
    ok = {"w": w, "ws": ws, "heads": 2, "freqs": freqs}
    x17, _, _, _, pos17 = _inputs(17, 2, 61)
    w256 = R.make_weight(1024, 256, _gen(62))
    buf = torch.zeros(3 * 2 * 512 + 3 * K, dtype=torch.bfloat16)
    x_in_buf = buf[:3 * K].view(3, K)
    x_in_buf.copy_(x)
    overlapping = buf[1024:1024 + 3 * 1024].view(3, 2, 512)
    return [
        ("17 rows", _layer(**ok), x17, pos17, None, "17 rows"),
        ("0 rows", _layer(**ok), x[:0], pos[:0], None, "wq_b: input shape"),
        ("K 256", _layer(*w256, 2, freqs), R.make_activation(3, 256, _gen(63)), pos, None, "K=256"),
        ("fp16 input", _layer(**ok), x.half(), pos, None, "torch.float16"),
        ("strided input", _layer(**ok), torch.cat([x, x], 1)[:, ::2], pos, None, "contiguous"),
        ("q_out head stride", _layer(**ok), x, pos, torch.empty(3, 512, 2, dtype=torch.bfloat16).transpose(1, 2),
         "q_out"),
        ("q_out fp32", _layer(**ok), x, pos, torch.empty(3, 2, 512), "q_out"),
        ("q_out overlaps q", _layer(**ok), x_in_buf, pos, overlapping, "overlaps"),
        ("positions length", _layer(**ok), x, pos[:2], None, "positions"),
        ("positions float", _layer(**ok), x, pos.float(), None, "positions"),
        ("freqs complex128", _layer(w, ws, 2, freqs.to(torch.complex128)), x, pos, None, "freqs_cis"),
        ("heads vs weight rows", _layer(w, ws, 3, freqs), x, pos, None, "3 heads"),
        ("fp8_gemm off", _layer(**ok, linear=lambda *a: None), x, pos, None, "not v4flash's"),
        ("marlin", _layer(**ok, use_marlin=True), x, pos, None, "Marlin"),
        ("64x64 blocks", _layer(**ok, block=[64, 64]), x, pos, None, "weight_block_size"),
        ("bias", _layer(**ok, bias=torch.zeros(1024)), x, pos, None, "bias"),
        ("gathered output", _layer(**ok, gather_output=True), x, pos, None, "gathers"),
        ("head_dim 256", _layer(**ok, head_dim=256), x, pos, None, "head_dim"),
        ("rope 32", _layer(**ok, rope=32), x, pos, None, "rope"),
    ]


def test_every_call_the_fused_path_does_not_compute_goes_to_upstream(upstream_method):
    for name, layer, q, pos, q_out, why in _refusals():
        upstream_method.clear()
        assert op.compute_q_b(layer, q, pos, q_out) == "upstream", name
        assert len(upstream_method) == 1, name
        got = upstream_method[0]
        assert got[0] is layer and got[1] is q and got[2] is pos and got[3] is q_out, name  # untouched, in order
        ops = op.layer_operands(layer)
        if isinstance(ops, str):
            call_why: str | None = ops
        else:
            call_why = op.unsupported(q, ops[0], ops[1], layer.n_local_heads, layer.freqs_cis, pos, q_out)
        assert call_why is not None and why in call_why, (name, call_why)


def test_a_refused_layer_is_said_once_per_reason(upstream_method):
    import logging

    x, w, ws, freqs, pos = _inputs(2, 1, 70)
    layer = _layer(w, ws, 1, freqs, use_marlin=True)
    seen: list = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    op.log.addHandler(handler)
    op._said.clear()
    try:
        for _ in range(3):
            op.compute_q_b(layer, x, pos)
    finally:
        op.log.removeHandler(handler)
    lines = [m for m in seen if "q norm + RoPE fusion not used" in m]
    assert len(lines) == 1 and "Marlin" in lines[0]
    detail = op.status_detail()
    assert list(detail["refused"].values()) == [3] and "Marlin" in detail["summary"]


def test_without_upstream_loaded_a_refused_call_raises(monkeypatch):
    monkeypatch.delitem(sys.modules, QNORM_ROPE.target_module, raising=False)
    x, w, ws, freqs, pos = _inputs(17, 1, 80)
    with pytest.raises(NotImplementedError, match="not loaded"):
        op.compute_q_b(_layer(w, ws, 1, freqs), x, pos)


def test_functional_op_refuses_loudly():
    x, w, ws, freqs, pos = _inputs(17, 1, 81)
    with pytest.raises(ValueError, match="17 rows"):
        op.qnorm_rope(x, w, ws, 1, EPS, freqs, pos)


def test_production_shapes_are_fused():
    """DeepSeek-V4-Flash's wq_b at TP4 (16 heads) and TP2 (32): every decode/verify row count 1..16 is fused;
    17 is not."""
    freqs = R.make_freqs_cis(8)
    for heads in (16, 32):
        w = torch.empty((heads * 512, K), dtype=torch.float8_e4m3fn)
        ws = torch.empty((heads * 4, K // 128))
        for m in (1, 2, 3, 4, 8, 12, 16, 17):
            x = torch.empty((m, K), dtype=torch.bfloat16)
            pos = torch.zeros(m, dtype=torch.int64)
            padded = torch.empty((m, 64, 512), dtype=torch.bfloat16)
            for q_out in (None, padded[:, heads:2 * heads]):
                why = op.unsupported(x, w, ws, heads, freqs, pos, q_out)
                assert (why is None) == (m <= 16), (heads, m, why)


def test_plan_tables():
    cfgs = op.launchable()
    assert cfgs[0] == op.CONFIG and len({c.name for c in cfgs}) == len(cfgs)
    assert all(128 % c.block_k == 0 and c.num_stages >= 1 and c.num_warps in (4, 8, 16) for c in cfgs)
    assert op.MAX_ROWS == op.BM == 16


# ----------------------------------------------------------------------------- the step bench's rows


def test_step_model_fuses_the_q_path_on_the_patched_path_at_decode_rows_when_opted_in():
    """With the switch opted in and up to 16 rows, the patched path has one fused row instead of wq_b + the
    norm/RoPE proxy (which the upstream path keeps); prefill rows keep both rows on both paths (the drop-in
    hands them to upstream). Without the opt-in (the switch is off by default) neither path fuses."""
    from v4flash_bench.step import model as M

    assert M.QNORM_ROPE_MAX_ROWS == op.MAX_ROWS
    on = ("qnorm_rope",)
    for spec, fused in ((M.decode_specs([4], [128 * 1024], 8192, 16, opt_in=on)[0], True),
                        (M.verify_specs([4], [2], 128 * 1024, 8192, 16, opt_in=on)[0], True),
                        (M.prefill_specs([1024], 16, opt_in=on)[0], False),
                        (M.decode_specs([4], [128 * 1024], 8192, 16)[0], False),
                        (M.verify_specs([4], [2], 128 * 1024, 8192, 16)[0], False)):
        ops = M.step_ops(spec)
        for path in ("upstream", "patched"):
            names = [o.name for o in M.ops_for_path(ops, path) if not o.name.startswith("draft: ")]
            has_fused = M.QNORM_ROPE_NAME in names
            assert has_fused == (fused and path == "patched"), (spec.label, path)
            assert ("wq_b (FP8)" in names) == ("q norm + RoPE (JIT)" in names) == (not has_fused), (spec.label, path)
    row = next(o for o in M.step_ops(M.decode_specs([4], [128 * 1024], 8192, 16, opt_in=on)[0])
               if o.name == M.QNORM_ROPE_NAME)
    assert row.patch == "qnorm_rope" and row.p["m"] == 4 and row.p["heads"] == 16 and row.flops == 2 * 4 * 8192 * 1024
    assert row.bytes > 8192 * 1024  # at least wq_b's weight


def test_step_builder_runs_the_drop_in_and_checks_it(monkeypatch):
    from v4flash_bench.step import model as M
    from v4flash_bench.step import ops as O
    from v4flash_bench.step.ops import common

    monkeypatch.setattr(common, "DEVICE", "cpu")
    row = M.q_path_ops(3, 1, 1)[1]  # the fused row at 3 rows, one head
    prep = O.build(row, "ours", 1 << 20, 4)
    chk = prep.check()
    assert chk.ok and "unfused composition" in chk.detail, chk
    assert prep.calls >= 1 and prep.one is not None
    prep.run()
    with pytest.raises(common.Unavailable):
        O.build(row, "upstream", 1 << 20, 4)
    # a wrong kernel fails the check
    monkeypatch.setattr(common, "patch_function", lambda patch: (
        lambda self, q, pos, q_out=None: op.compute_q_b(self, q, pos, q_out).mul_(1.05), "ours: broken"))
    assert not O.build(row, "ours", 1 << 20, 4).check().ok
