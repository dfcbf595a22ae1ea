"""CPU tests of the fused compressor under TRITON_INTERPRET=1: the plan, every window branch, the store
formats' rounding, the drop-in's routing, and agreement with fp64 and with upstream.

Every fused step is checked by `reference.check_step`: the state ring against fp64 within the fp32
GEMV's accumulation bound (rows the step does not write: bit for bit), each completed window's stored
token dequantized against fp64 within the format's rounding at its scale plus what the fp32 arithmetic
before it can contribute, its scales among those the computation may pick, every other cache byte as
it was. Upstream here is the wheel's HIP Triton statement of the same step (`compressor.upstream`:
torch GEMM + `fused_compress_triton`'s decode kernels + its norm/RoPE(/Hadamard) kernels); its FP8
store needs a GPU (the interpreter truncates Triton's fp8 casts), so on the CPU ours is compared with
its state ring and its rows before the quant.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch
import triton
import triton.language as tl

from v4flash_kernels.compressor import kernel as K
from v4flash_kernels.compressor import op
from v4flash_kernels.compressor import reference as R
from v4flash_kernels.compressor import upstream as U
from v4flash_kernels.compressor.sglang_objects import ForwardBatch, ForwardMode, objects
from v4flash_kernels.selfcheck.case import SMALL, Target

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)
KINDS = [(4, 512), (128, 512), (4, 128)]
IDS = ["c4", "c128", "indexer"]


def _run(case) -> None:
    freqs = torch.view_as_real(case["freqs_cis"]).flatten(-2)
    op.compress_decode(case["x"], case["weight"], case["state"], case["plan_d"], case["ape"], case["norm_weight"],
                       case["eps"], freqs, case["out_loc"], case["cache"], case["page_size"], ratio=case["ratio"],
                       head_dim=case["head_dim"])


def _check(case, rows=None):
    ref = R.step_ref(case)
    before = case["cache"].clone()
    _run(case)
    ok, metrics, why = R.check_step(case, ref, case["state"], case["cache"], before, rows)
    assert ok, (why, metrics)
    return ref, metrics


# ----------------------------------------------------------------------------- the plan


def test_plan_is_a_function_of_the_compressor_kind_and_the_rows():
    """Per kind two variants: up to 4 rows the CUDA-core GEMV from one load of each program's whole tile
    (8 or 4 weight rows x K, unpadded), 5-16 rows the tensor-core GEMV (T and the rows padded to 16);
    128-256 programs, each owning whole kv + score columns of its head dims; no plan for a kind
    DeepSeek-V4 does not have."""
    for ratio, hd in KINDS:
        sections = 4 if ratio == 4 else 2
        for rows in range(1, op.MAX_ROWS + 1):
            p = op.plan_for(ratio, hd, 4096, rows)
            assert p.mma == (rows > op.FMA_ROWS) and rows <= p.block_t and hd % p.bd == 0
            assert p.programs in (128, 256) and p.indexer == (hd == 128) and 4096 % p.bk == 0
            assert p.rows_pad & (p.rows_pad - 1) == 0 and p.rows_pad >= sections * p.bd
            assert p.rows_pad == (max(16, sections * p.bd) if p.mma else sections * p.bd)
        assert op.plan_for(ratio, hd, 4096, 4) != op.plan_for(ratio, hd, 4096, 5)
    assert len(op.launchable()) == 6 and {(p.ratio, p.head_dim, p.mma) for p in op.launchable()} == {
        (r, d, m) for r, d in KINDS for m in (False, True)}
    with pytest.raises(KeyError):
        op.plan_for(128, 128, 4096)


# ----------------------------------------------------------------------------- the step against fp64


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("ratio,hd", KINDS, ids=IDS)
def test_production_step_matches_fp64(ratio, hd, rows):
    """DeepSeek-V4-Flash's wkv_gate (2048 / 1024 / 512 x 4096), on the CUDA cores (1 row) and the tensor
    cores (5 rows), on a realistic ring: the first window, deep windows, one just past an SWA page, rows
    that complete none, a CUDA-graph padding row."""
    case = R.make_case(rows, ratio, hd, 4096, seed=11)
    assert op.plan_for(ratio, hd, 4096, rows).mma == (rows == 5)
    ref, metrics = _check(case)
    seqs = case["seq_lens"]
    assert list(ref.done) == [t for t, s in enumerate(seqs) if s % ratio == 0] and len(ref.done) == {1: 1, 5: 2}[rows]
    assert metrics["store_excess"] > 0  # the tokens were read back and compared, not skipped


@pytest.mark.parametrize("ratio,hd", KINDS, ids=IDS)
def test_every_window_branch(ratio, hd):
    """16 rows (the whole padded T): the first window (c4: no overlap half), windows whose previous page
    lies in the previous SWA page, deep windows, every offset inside a window, the padding row."""
    swa = ratio * (R.SWA_PAGE // ratio + 1)
    seqs = [ratio, 2 * ratio, swa, swa + ratio, 7 * ratio + 1, 7 * ratio + 2, 7 * ratio + ratio - 1, 9 * ratio,
            ratio + 1, 3 * ratio, 5 * ratio - 1, 40 * ratio, 2, 41 * ratio, 3, 1]
    case = R.make_case(16, ratio, hd, 256, seed=3, seq_lens=seqs)
    ref, _ = _check(case)
    assert len(ref.done) == sum(s % ratio == 0 for s in seqs) == 8


@pytest.mark.parametrize("ratio,hd", KINDS, ids=IDS)
def test_a_step_without_a_completed_window_only_updates_the_ring(ratio, hd):
    case = R.make_case(3, ratio, hd, 256, seed=5, seq_lens=[ratio + 1, 2 * ratio + 3, 1])
    before = case["cache"].clone()
    ref, metrics = _check(case)
    assert ref.done == () and metrics["rows_completed"] == 0 and torch.equal(case["cache"], before)


def test_one_row():
    case = R.make_case(1, 4, 512, 256, seed=7, seq_lens=[4 * 9])
    ref, _ = _check(case)
    assert ref.done == (0,)


def test_checks_fail_on_a_wrong_step():
    """The comparison can fail: a window pooled with the wrong bias, RoPE one position off, a norm
    weight 1 % off, a ring row left unwritten, a byte outside the tokens changed."""
    for name, mutate in [("ape", lambda c: {"ape": c["ape"].roll(1, 0).contiguous()}),
                         ("rope", lambda c: {"freqs_cis": c["freqs_cis"].roll(-1, 0).contiguous()}),
                         ("norm", lambda c: {"norm_weight": c["norm_weight"] * 1.01})]:
        case = R.make_case(3, 4, 512, 256, seed=2, seq_lens=[8, 13, 1])
        ref = R.step_ref(case)
        before = case["cache"].clone()
        _run({**case, **mutate(case)})
        ok, _, why = R.check_step(case, ref, case["state"], case["cache"], before)
        assert not ok and "stored tokens" in why, name
    case = R.make_case(3, 4, 512, 256, seed=2, seq_lens=[8, 13, 1])
    ref = R.step_ref(case)
    before = case["cache"].clone()
    _run(case)
    state = case["state"].clone()
    state[int(case["plan_d"][1, 1])] = ref.state[int(case["plan_d"][1, 1])].float() * 1.001
    assert "state rows off" in R.check_step(case, ref, state, case["cache"], before)[2]
    cache = case["cache"].clone()
    cache[-1, -1] ^= 1
    assert "outside" in R.check_step(case, ref, case["state"], cache, before)[2]


# ----------------------------------------------------------------------------- the store formats' rounding


@triton.jit
def _round_kernel(X, B, C, E, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(X + i)
    tl.store(B + i, K.bf16_rne(x))
    tl.store(C + i, K.e4m3_code(tl.clamp(x, -448.0, 448.0)))
    e, _ = K.ue8m0_of(tl.abs(x) + 1e-30)
    tl.store(E + i, e)


def test_bf16_e4m3_and_ue8m0_roundings_are_the_hardware_ones():
    """Every e4m3 code's value, the midpoints between neighbours (ties to even), just off them, the
    subnormals and the saturation; bf16 ties; UE8M0 rounds a scale up to a power of two."""
    vals = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()
    pos = vals[vals >= 0].sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([vals, mids, -mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), torch.tensor([500.0, -1e4]),
                   torch.randn(2000) * 30, torch.randn(1000) * 0.01])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).float()
    b, c, e = torch.empty_like(x), torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.int32)
    _round_kernel[(1,)](x, b, c, e, N=n)
    assert torch.equal(b, x.to(torch.bfloat16).float())
    assert torch.equal(c, x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    want = torch.ceil(torch.log2((x.abs() + 1e-30).double())) + 127
    assert torch.equal(e.double(), want)


# ----------------------------------------------------------------------------- against upstream


@pytest.mark.parametrize("ratio,hd", KINDS, ids=IDS)
def test_ring_and_rows_agree_with_upstream_step_after_step(ratio, hd):
    """Consecutive decode steps of 3 requests (windows completing and not) from one ring: after every
    step our ring equals upstream's (torch GEMM + HIP Triton compress) but for the fp32 accumulation
    order of the new rows, and our stored tokens hold upstream's normalised rows (HIP Triton norm +
    RoPE (+ Hadamard)) within the quant's rounding; upstream's rows agree with fp64 too."""
    start = [ratio - 2, 3 * ratio - 1, 5 * ratio + 1]
    case = R.make_case(3, ratio, hd, 256, seed=9, seq_lens=start)
    up = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in case.items()}
    completed = 0
    bound = torch.zeros_like(case["state"], dtype=torch.float64)  # each row's bound as last written
    for step in range(ratio + 2 if ratio == 4 else 3):
        seqs = [s + step for s in start]
        plan = torch.tensor([R.plan_row(i, s, ratio) for i, s in enumerate(seqs)], dtype=torch.int32)
        case["plan_d"].copy_(plan)
        up["plan_d"].copy_(plan)
        x = (torch.randn(case["x"].shape, generator=torch.Generator().manual_seed(step)) * 1.5).to(torch.bfloat16)
        case["x"].copy_(x)
        up["x"].copy_(x)
        ref, _ = _check(case)
        _, y_up = U.step(up, with_store=False)
        new = ref.state_bound.abs().sum(1) > 0
        bound[new] = ref.state_bound[new]
        written = bound.sum(1) > 0
        assert torch.equal(case["state"][~written], up["state"][~written]), step  # never written: untouched
        assert bool(((case["state"] - up["state"]).abs() <= 2 * bound).all()), step
        done = list(ref.done)
        completed += len(done)
        if done:
            y = y_up[done].double()
            assert bool(((y - ref.y[done]).abs() <= ref.y_bound[done]).all()), step  # upstream vs fp64
            got = R.read_tokens(case["cache"], [int(case["out_loc"][t]) for t in done], case["page_size"], hd)
            b = R.store_bound(y, ref.y_bound[done], hd)["bound"]
            assert bool(((got["values"] - y).abs() <= b).all()), step
    assert completed >= 2


# ----------------------------------------------------------------------------- the drop-in


class _Plan:
    def __init__(self, ratio, plan_d, is_decode):
        self.compress_ratio, self.plan_d, self.is_decode = ratio, plan_d, is_decode


def _objs(ratio=4, hd=512, rows=2, k=256):
    case = R.make_case(rows, ratio, hd, k, seed=1, seq_lens=[ratio * (i + 2) for i in range(rows)])
    return case, objects(case)


def test_decline_takes_exactly_the_decode_steps_it_fuses(monkeypatch):
    case, kw = _objs()
    args = (kw["self"], kw["x"], kw["forward_batch"], kw["compressor"])
    assert op.decline(*args) is None
    call = op.gather(kw["self"], kw["x"], 0, kw["compressor"])
    assert isinstance(call, op.Call) and call.problem() is None
    assert op.decline(kw["self"], kw["x"], ForwardBatch(ForwardMode(idle=True)), kw["compressor"]) == "idle batch"
    assert op.decline(kw["self"], kw["x"], ForwardBatch(attn_cp_metadata=object()), kw["compressor"]) == \
        "context parallelism"
    kw["self"].plan = _Plan(4, kw["self"].plan.plan_d, is_decode=False)
    assert "not a decode plan" in op.decline(*args)
    kw["self"].plan = _Plan(128, kw["self"].plan.plan_d, is_decode=True)
    assert op.decline(*args) == "plan of another ratio"
    case, kw = _objs(hd=128)
    kw["self"].enable_deepseek_v4_fp4_indexer = True
    assert op.decline(kw["self"], kw["x"], kw["forward_batch"], kw["compressor"]) == "FP4 indexer cache"
    # upstream's module decides HIP and the online c128 state
    v2 = types.ModuleType(op.V2_MODULE)
    v2._is_hip = True
    v2._use_online_compress = lambda r: r == 128
    monkeypatch.setitem(sys.modules, op.V2_MODULE, v2)
    case, kw = _objs()
    assert op.decline(kw["self"], kw["x"], kw["forward_batch"], kw["compressor"]) == "HIP"
    v2._is_hip = False
    case, kw = _objs(ratio=128)
    assert "online c128" in op.decline(kw["self"], kw["x"], kw["forward_batch"], kw["compressor"])


def test_shape_problems_send_the_call_to_upstream():
    case, kw = _objs()
    call = op.gather(kw["self"], kw["x"], 0, kw["compressor"])
    assert call.problem() is None
    bad = {
        "rows": {"x": torch.zeros((17, 256), dtype=torch.bfloat16)},
        "x dtype": {"x": case["x"].float()},
        "weight": {"weight": case["weight"].float()},
        "state": {"state": case["state"][:, :-1]},
        "plan": {"plan_d": torch.zeros((3, 16), dtype=torch.uint8)},
        "ape": {"ape": case["ape"].double()},
        "norm": {"norm_weight": case["norm_weight"].bfloat16()},
        "freqs": {"freqs_cis": torch.view_as_real(case["freqs_cis"]).flatten(-2)},
        "out_loc": {"out_loc": case["out_loc"].long()},
        "page": {"page_size": 48},
        "cache": {"cache": case["cache"][:, :-8]},
    }
    for name, change in bad.items():
        assert dataclasses.replace(call, **change).problem() is not None, name
    assert op.shape_problem(*[getattr(call, f) for f in ("x", "weight", "state", "plan_d", "ape", "norm_weight",
                                                          "freqs_cis", "out_loc", "cache", "page_size")], 128, 128)


def test_drop_in_fuses_a_decode_step_and_hands_the_rest_to_upstream(monkeypatch):
    """Through the stand-ins of SGLang's objects: a decode step is ours (the ring and the cache as
    fp64 says); an idle batch, a prefill plan or too many rows reach upstream's forward_unified (here a
    recorder standing in for compressor_v2's, which the hook tests run for real) with the same args."""
    calls = []
    v2 = types.ModuleType(op.V2_MODULE)
    v2._is_hip = False
    v2._use_online_compress = lambda r: False
    v2.CompressorBackendMixin = type("CompressorBackendMixin", (), {
        "forward_unified": lambda self, x, forward_batch, layer_id, compressor: calls.append((self, x, layer_id))})
    monkeypatch.setitem(sys.modules, op.V2_MODULE, v2)
    case, kw = _objs()
    ref = R.step_ref(case)
    before = case["cache"].clone()
    assert op.forward_unified(**kw) is None and calls == []
    ok, metrics, why = R.check_step(case, ref, case["state"], case["cache"], before)
    assert ok and metrics["rows_completed"] == 2, why
    op.forward_unified(**{**kw, "forward_batch": ForwardBatch(ForwardMode(idle=True))})
    kw["self"].plan = _Plan(4, kw["self"].plan.plan_d, is_decode=False)
    op.forward_unified(**kw)
    case2, kw2 = _objs(rows=17)
    op.forward_unified(**kw2)
    assert [c[2] for c in calls] == [0, 0, 0] and calls[2][1] is kw2["x"]


def test_upstream_forward_unified_prefers_the_hooks_kept_original(monkeypatch):
    from v4flash_kernels.hook.hook import upstream_keep_attr
    from v4flash_kernels.hook.patches import COMPRESSOR_CORE

    v2 = types.ModuleType(op.V2_MODULE)
    mixin = type("CompressorBackendMixin", (), {"forward_unified": lambda *a: "mixin"})
    v2.CompressorBackendMixin = mixin
    monkeypatch.setitem(sys.modules, op.V2_MODULE, v2)
    assert op.upstream_forward_unified()() == "mixin"
    setattr(v2, upstream_keep_attr(COMPRESSOR_CORE), lambda *a: "kept")
    assert op.upstream_forward_unified()() == "kept"
    monkeypatch.setitem(sys.modules, op.V2_MODULE, types.ModuleType(op.V2_MODULE))
    with pytest.raises(RuntimeError, match="not loaded"):
        op.upstream_forward_unified()


# ----------------------------------------------------------------------------- the self-check and the bench


def test_selfcheck_cases_follow_the_target():
    from v4flash_kernels.compressor import selfcheck

    t = Target(device="cpu", batches=(1, 16, 64), verify_rows=(48,), prefill_rows=8192)
    names = {c.name: c for c in selfcheck.cases(t)}
    for kind in ("c4 2048x4096", "c128 1024x4096", "indexer c4 512x4096"):
        assert f"{kind} T=1" in names and names[f"{kind} T=16"].graph and not names[f"{kind} T=1"].graph
        assert f"{kind} T=64" not in names and f"{kind} T=48" not in names  # upstream's path
    assert all(c.upstream is None and c.upstream_skip for c in names.values())
    cpu = selfcheck.cases(Target(device="cpu", small_only=True))
    assert len(cpu) == 3 and all(c.size == SMALL for c in cpu)
    a, b = (R.make_case(4, 128, 512, 256, seed=s) for s in (1, 2))
    assert {k: tuple(v.shape) for k, v in a.items() if torch.is_tensor(v)} == {
        k: tuple(v.shape) for k, v in b.items() if torch.is_tensor(v)}


def test_step_builder_checks_on_cpu(monkeypatch):
    from v4flash_bench.step import model as M
    from v4flash_bench.step.ops import common as C
    from v4flash_bench.step.ops import compressor as build_mod

    monkeypatch.setattr(C, "DEVICE", "cpu")
    op_row = [o for o in M.decode_ops(M.StepSpec("decode", 1, 131072, 8192)) if o.patch == "compressor_indexer"][0]
    assert op_row.p["variant"] == "patched" and op_row.count == 21
    with pytest.raises(C.Unavailable):
        build_mod.build(op_row, "upstream", 1 << 20, 3)
    prep = build_mod.build(op_row, "ours", 1 << 20, 3)
    chk = prep.check()
    assert chk.ok, chk
    assert prep.source.startswith("ours: v4flash_kernels.compressor.op.forward_unified")
