"""IPC all-reduce on CPU: the plan and layout, the epoch/flag protocol (a model checker and the real
kernels in N processes under Triton's interpreter), the fallback decisions, and the SGLang drop-in."""

from __future__ import annotations

import random
import sys
import types
from typing import Dict, List

import pytest
import torch
from allreduce_ranks import Call, run

from v4flash_kernels.allreduce import op, policy
from v4flash_kernels.allreduce import plan as P
from v4flash_kernels.allreduce.reference import all_reduce_ref, max_ulp_error

MB = 1024 * 1024


# ----------------------------------------------------------------------------- plan and layout


@pytest.mark.parametrize("world", P.WORLDS)
def test_one_shot_below_the_threshold_two_shot_above(world):
    t = P.ONE_SHOT_MAX[world]
    assert not P.plan(t // 2, 2, world).two_shot
    if t < P.DEFAULT_MAX_BYTES:
        assert P.plan(t // 2 + 8, 2, world).two_shot
    assert P.plan(1, 2, world).ctas == 1 and not P.plan(1, 2, world).two_shot


def test_thresholds_fall_with_the_rank_count():
    values = [P.ONE_SHOT_MAX[n] for n in range(2, 9)]
    assert values == sorted(values, reverse=True) and values[0] == P.DEFAULT_MAX_BYTES  # 2 ranks: always one-shot
    assert P.ONE_SHOT_MAX[4] >= 64 * 1024  # TP4 decode's 16-64 KB messages are one flag round


def test_seven_ranks_fall_back_to_nccl():
    """7 is no DeepSeek-V4 TP size, and its two-shot probe binary spills on sm_90: NCCL's, said so."""
    from v4flash_kernels.allreduce import policy

    assert not P.world_ok(7) and P.world_ok(8)
    with pytest.raises(ValueError, match="supported are"):
        P.plan(64, 2, 7)
    v = policy.group_eligible(7, use_custom_allreduce=True, upstream_custom_active=False, device_type="cuda")
    assert not v.ok and "7" in v.reason


def _sizes() -> List[int]:
    out = {1, 2, 3, 7, 8, 63, 64, 65, 4095, 4096, 4097, 8191, 1 << 20, (1 << 20) + 3}
    out |= {P.ONE_SHOT_MAX[n] // 2 + d for n in range(2, 9) for d in (-1, 0, 1)}
    out |= {P.DEFAULT_MAX_BYTES // 2 - 1, P.DEFAULT_MAX_BYTES // 2}
    return sorted(out)


@pytest.mark.parametrize("esize", P.ELEMENT_SIZES)
@pytest.mark.parametrize("world", P.WORLDS)
def test_every_plan_fits_the_layout_and_covers_the_message(world, esize):
    layout = P.Layout()
    for numel in _sizes():
        if numel * esize > layout.max_bytes:
            continue
        for forced in (None, False, True):
            p = P.plan(numel, esize, world, layout, two_shot=forced)
            assert p.footprint() <= layout.half_bytes, p
            assert (p.slot * esize) % P.ALIGN_BYTES == 0 and p.span % p.block == 0
            assert 1 <= p.ctas <= P.MAX_CTAS and p.span * p.ctas >= p.slot
            covered = p.slot * (p.world if p.two_shot else 1)
            assert covered >= numel  # every element has an owner chunk / a CTA
            if forced is not None and forced is False and not p.two_shot:
                assert p.world * p.slot * esize <= layout.half_bytes


def test_layout_regions_do_not_overlap():
    lay = P.Layout()
    assert P.STATE_OFF + 8 * (P.STATE_ERROR + 1) <= P.FLAGS1_OFF
    assert P.Layout.flag_off(1, P.MAX_RANKS - 1, P.MAX_CTAS - 1) + 8 <= P.FLAGS2_OFF
    assert P.Layout.flag_off(2, P.MAX_RANKS - 1, P.MAX_CTAS - 1) + 8 <= P.DATA_OFF
    assert lay.half_off(1) == P.DATA_OFF + lay.half_bytes and lay.half_off(2) == P.DATA_OFF
    assert lay.total_bytes == P.DATA_OFF + 2 * lay.half_bytes and lay.half_bytes % 4096 == 0


@pytest.mark.parametrize("bad", [{"world": 1}, {"world": 9}, {"numel": 0}, {"numel": P.DEFAULT_MAX_BYTES},
                                 {"esize": 1}, {"esize": 8}, {"ctas": 0}, {"ctas": P.MAX_CTAS + 1}])
def test_plan_refuses_what_it_cannot_compute(bad):
    args = {"numel": 1024, "esize": 2, "world": 4, "ctas": None}
    args.update(bad)
    with pytest.raises(ValueError):
        P.plan(args["numel"], args["esize"], args["world"], ctas=args["ctas"])


def test_fits_is_what_the_communicator_takes():
    lay = P.Layout(1 * MB)
    assert P.fits(2, 2, lay) and P.fits(MB, 4, lay)
    assert not P.fits(0, 2, lay) and not P.fits(MB + 2, 2, lay) and not P.fits(16, 8, lay) and not P.fits(3, 2, lay)


def test_epochs_and_flags():
    assert P.next_epoch(0) == 1  # a fresh (zeroed) buffer's first call
    assert not P.flag_ready(0, P.next_epoch(0))  # zeroed flags never release it
    assert P.flag_ready(5, 5) and P.flag_ready(6, 5)  # a peer one call ahead already released this one
    assert not P.flag_ready(4, 5)


# ----------------------------------------------------------------------------- the protocol, model-checked


def _model(world: int, calls: int, two_shot: bool, halves: int, seed: int) -> List[str]:
    """Interleave every rank's steps at random; return the stale reads seen (should be none).

    Each write of rank r into peer p's half for epoch e is tagged with e; a read of call e must see
    tags of e. The halves index and flag rule are `plan`'s; `halves=1` is the broken variant.
    """
    rng = random.Random(seed)
    rounds = 2 if two_shot else 1
    stored = [0] * world
    data: List[Dict[tuple, int]] = [{} for _ in range(world)]  # (half, round, src) -> epoch tag
    flags = [[[0] * world for _ in range(rounds)] for _ in range(world)]  # flags[receiver][round][src]
    bad: List[str] = []

    def rank_prog(r):
        for _ in range(calls):
            e = P.next_epoch(stored[r])
            h = e % halves
            for rd in range(rounds):
                for p in range(world):
                    if p != r:
                        data[p][(h, rd, r)] = e
                        yield
                for p in range(world):
                    if p != r:
                        flags[p][rd][r] = e
                        yield
                for s in range(world):
                    while s != r and not P.flag_ready(flags[r][rd][s], e):
                        yield
                for s in range(world):
                    if s != r:
                        if data[r].get((h, rd, s)) != e:
                            bad.append(f"rank {r} call {e} round {rd} read {data[r].get((h, rd, s))} from {s}")
                        yield
            stored[r] = e

    progs = {r: rank_prog(r) for r in range(world)}
    while progs:
        r = rng.choice(sorted(progs))
        try:
            next(progs[r])
        except StopIteration:
            del progs[r]
    assert stored == [calls] * world
    return bad


@pytest.mark.parametrize("two_shot", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_two_halves_never_let_a_peer_overwrite_unread_data(world, two_shot):
    for seed in range(40):
        assert _model(world, 6, two_shot, halves=2, seed=seed) == []


def test_the_model_catches_a_single_half():
    """The checker can fail: with one half a fast peer overwrites a slow rank's unread data."""
    assert any(_model(3, 6, False, halves=1, seed=s) for s in range(200))


# ----------------------------------------------------------------------------- the kernels, N processes


def _inputs(calls, world, gen, integers):
    xs = []
    for c in calls:
        if integers:
            per = [torch.randint(-16, 17, (c.numel,), generator=gen).to(c.dtype) for _ in range(world)]
        else:  # positive: no cancellation, so the fp64 sum rounded is within one ulp of what fp32 gives
            per = [torch.rand(c.numel, generator=gen).to(c.dtype) for _ in range(world)]
        xs.append(per)
    return xs


def _check(calls, xs, got, world, exact):
    for i, c in enumerate(calls):
        ref = all_reduce_ref(xs[i])
        for r in range(world):
            assert got[i][r].dtype == c.dtype and got[i][r].shape == (c.numel,)
            assert torch.equal(got[i][r], got[i][0]), f"call {i}: rank {r} differs from rank 0"
        if exact:
            assert torch.equal(got[i][0].double(), ref), f"call {i} {c}: not the exact sum"
        else:  # the interpreter truncates fp32 -> bf16 (a GPU rounds): < 1 ulp either way
            limit = 1.0 if c.dtype == torch.bfloat16 else float(world)
            assert max_ulp_error(got[i][0], ref) <= limit, f"call {i} {c}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_kernels_in_processes_exact_sums_over_many_calls(world):
    """Both algorithms, several CTAs, odd sizes, in place: the epoch advances through both halves."""
    calls = [Call(1, two_shot=False), Call(37, two_shot=True), Call(5000, two_shot=False, ctas=3),
             Call(6000, two_shot=True, ctas=2), Call(4096, in_place=True), Call(3 * 4096 + 5, two_shot=True, ctas=3,
                                                                               in_place=True),
             Call(2048, dtype=torch.float32, two_shot=False, ctas=2), Call(999, dtype=torch.float32, two_shot=True)]
    gen = torch.Generator().manual_seed(world)
    xs = _inputs(calls, world, gen, integers=True)
    got, names, bufs = run(world, calls, xs, max_bytes=64 * 1024)
    _check(calls, xs, got, world, exact=True)
    want = [P.plan(c.numel, torch.empty(0, dtype=c.dtype).element_size(), world, P.Layout(64 * 1024), c.two_shot,
                   c.ctas).name for c in calls]
    assert names == [want] * world
    for b in bufs:  # every rank's epoch = calls made; the arrival counter reset itself; no time-out
        state = b[:24].view(torch.int64).tolist()
        assert state == [len(calls), 0, 0]


@pytest.mark.timeout(600)
def test_kernels_in_processes_random_floats_within_one_ulp():
    calls = [Call(3000), Call(3000, two_shot=True, ctas=2), Call(1500, dtype=torch.float32, two_shot=True)]
    gen = torch.Generator().manual_seed(7)
    xs = _inputs(calls, 2, gen, integers=False)
    got, _, _ = run(2, calls, xs, max_bytes=64 * 1024)
    _check(calls, xs, got, 2, exact=False)


def test_compile_only_starts_nothing():
    """The probe compiles on every rank before any rank launches: a warm-up must not run the kernel
    (with a missing peer it would wait for ever)."""
    from v4flash_kernels.allreduce.launch import launch

    lay = P.Layout(64 * 1024)
    bufs = [torch.zeros(lay.total_bytes, dtype=torch.uint8) for _ in range(2)]
    x = torch.ones(1024, dtype=torch.bfloat16)
    out = torch.zeros_like(x)
    for two_shot in (False, True):
        launch(x, out, [b.data_ptr() for b in bufs], 0, lay, two_shot=two_shot, compile_only=True)
    assert not out.any() and not bufs[0].any() and not bufs[1].any()


# ----------------------------------------------------------------------------- fallback decisions


def test_group_eligible():
    assert policy.group_eligible(4, True, False, "cuda").ok
    assert not policy.group_eligible(4, True, False, "cpu").ok
    assert not policy.group_eligible(1, True, False, "cuda").ok and not policy.group_eligible(9, True, False, "cuda").ok
    v = policy.group_eligible(4, False, False, "cuda")
    assert not v.ok and "--disable-custom-all-reduce" in v.reason
    v = policy.group_eligible(2, True, True, "cuda")
    assert not v.ok and "own custom all-reduce is active" in v.reason


def test_agreement_names_the_first_failing_rank():
    assert policy.agree([(True, ""), (True, "")]).ok
    v = policy.agree([(True, ""), (False, "cudaIpcOpenMemHandle failed"), (False, "x")])
    assert not v.ok and v.reason == "rank 1: cudaIpcOpenMemHandle failed"


def test_peer_access_matrix():
    assert policy.peers_mappable(["a", "b"], [[None, True], [True, None]]).ok
    assert policy.peers_mappable(["a", "b"], [[None, None], [None, None]]).ok  # not visible: IPC open decides
    v = policy.peers_mappable(["a", "b", "c"], [[None, True, True], [True, None, False], [True, True, None]])
    assert not v.ok and "rank 1 cannot access the GPU of rank 2" in v.reason and "doctor" in v.reason
    assert not policy.peers_mappable(["a", "a"], [[None, None], [None, None]]).ok


def test_probe_verdicts():
    assert policy.probe_verdict([True] * 4, [8.0, 9.0, 8.5, 8.0], [15.0, 15.2, 14.9, 15.0], 65536).ok
    v = policy.probe_verdict([True] * 4, [8.0, 90.0, 8.5, 8.0], [15.0, 15.2, 14.9, 15.0], 65536)
    assert not v.ok and "slow" in v.reason and "90.0 us" in v.reason  # the slowest rank decides
    v = policy.probe_verdict([True, False], [8.0, 8.0], [15.0, 15.0], 65536)
    assert not v.ok and "[1]" in v.reason
    assert policy.probe_verdict([True] * 2, [20.0, 20.0], None, 65536).ok
    assert not policy.probe_verdict([True] * 2, [20.0, 200.0], None, 65536).ok


# ----------------------------------------------------------------------------- the SGLang drop-in


class _Comm:
    def __init__(self, disabled=False, take=True):
        self.disabled, self.take, self.reason, self.probe_result = disabled, take, "probe said no", "8 us vs 15 us"
        self.layout, self.calls = P.Layout(), []

    def should(self, t):
        return self.take

    def all_reduce(self, inp, out=None):
        self.calls.append((inp, out))
        inp.mul_(4)  # stands for the sum over 4 equal ranks
        return inp


@pytest.fixture
def upstream(monkeypatch):
    """A stand-in parallel_state module holding upstream's method where the hook keeps it."""
    from v4flash_kernels.hook.hook import upstream_keep_attr
    from v4flash_kernels.hook.patches import ALLREDUCE

    seen = []

    def _all_reduce_in_place(self, input_):
        seen.append(input_)
        input_.add_(100)

    mod = types.ModuleType(ALLREDUCE.target_module)
    setattr(mod, upstream_keep_attr(ALLREDUCE), _all_reduce_in_place)
    monkeypatch.setitem(sys.modules, ALLREDUCE.target_module, mod)
    return seen


def _group(**kw):
    g = types.SimpleNamespace(world_size=4, use_custom_allreduce=True, ca_comm=None, device=torch.device("cuda", 0),
                              unique_name="tp:0", rank_in_group=0, cpu_group=None, device_group=None)
    g.__dict__.update(kw)
    return g


def test_drop_in_takes_eligible_calls_and_sets_up_once(monkeypatch, upstream):
    made = []
    monkeypatch.setattr(op, "make_communicator", lambda g: made.append(g) or _Comm())
    g = _group()
    for _ in range(3):
        t = torch.ones(8)
        assert op.group_all_reduce_in_place(g, t) is None
        assert torch.equal(t, torch.full((8,), 4.0))
    assert len(made) == 1 and not upstream


def test_drop_in_leaves_what_the_communicator_refuses_to_upstream(monkeypatch, upstream):
    monkeypatch.setattr(op, "make_communicator", lambda g: _Comm(take=False))
    t = torch.ones(8)
    op.group_all_reduce_in_place(_group(), t)
    assert torch.equal(t, torch.full((8,), 101.0)) and len(upstream) == 1


def test_drop_in_falls_back_for_good_and_says_so_once(monkeypatch, upstream, caplog):
    made = []
    monkeypatch.setattr(op, "make_communicator", lambda g: made.append(g) or _Comm(disabled=True))
    lines = []
    monkeypatch.setattr(op.log, "warning", lambda fmt, *a: lines.append(fmt % a))
    g = _group()
    for _ in range(3):
        op.group_all_reduce_in_place(g, torch.ones(8))
    assert len(made) == 1 and len(upstream) == 3
    assert len(lines) == 1 and "falls back to NCCL: probe said no" in lines[0] and "tp:0" in lines[0]


@pytest.mark.parametrize("kw", [{"use_custom_allreduce": False}, {"world_size": 1}, {"device": torch.device("cpu")},
                                {"ca_comm": types.SimpleNamespace(disabled=False, original_disabled=False)}])
def test_drop_in_never_sets_up_for_ineligible_groups(monkeypatch, upstream, kw):
    monkeypatch.setattr(op, "make_communicator", lambda g: pytest.fail("must not set up"))
    op.group_all_reduce_in_place(_group(**kw), torch.ones(8))
    assert len(upstream) == 1


def test_upstream_custom_all_reduce_briefly_disabled_by_the_graph_runner_stays_in_charge(monkeypatch, upstream):
    ca = types.SimpleNamespace(disabled=True, original_disabled=False)  # piecewise runner's temporary flip
    monkeypatch.setattr(op, "make_communicator", lambda g: pytest.fail("must not set up"))
    op.group_all_reduce_in_place(_group(ca_comm=ca), torch.ones(8))
    assert len(upstream) == 1


def test_no_set_up_inside_graph_capture(monkeypatch, upstream):
    made = []
    monkeypatch.setattr(op, "make_communicator", lambda g: made.append(g) or _Comm())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    g = _group()
    op.group_all_reduce_in_place(g, torch.ones(8))
    assert not made and len(upstream) == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    op.group_all_reduce_in_place(g, torch.ones(8))
    assert len(made) == 1 and len(upstream) == 1


def test_drop_in_without_sglang_loaded_raises_instead_of_guessing(monkeypatch):
    from v4flash_kernels.hook.patches import ALLREDUCE

    monkeypatch.delitem(sys.modules, ALLREDUCE.target_module, raising=False)
    with pytest.raises(NotImplementedError, match="not loaded"):
        op.group_all_reduce_in_place(_group(use_custom_allreduce=False), torch.ones(8))


def test_drop_in_has_upstreams_signature():
    import inspect

    params = list(inspect.signature(op.group_all_reduce_in_place).parameters)
    assert params == ["self", "input_"]


# ----------------------------------------------------------------------------- the PTX gate


_GOOD_PTX = """
bar.sync 0;
@%p9 atom.global.sys.release.exch.b64 %rd48, [ %rd49 + 0 ], %rd117;
@%p17 atom.global.acquire.sys.cas.b64 %rd46, [ %rd45 + 0 ], %rd47, %rd47;
atom.global.gpu.acq_rel.add.u64 %rd1, [ %rd2 + 0 ], 1;
atom.global.gpu.release.exch.b64 %rd3, [ %rd4 + 0 ], %rd5;
ld.global.cg.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd6 + 0 ];
st.global.v4.b32 [ %rd7 + 0 ], { %r1, %r2, %r3, %r4 };
"""


def test_ptx_gate_accepts_the_protocols_scopes_and_names_what_is_wrong():
    from v4flash_kernels.allreduce.compile import allreduce_ptx_problem

    assert allreduce_ptx_problem(_GOOD_PTX) == ""
    gpu_flags = _GOOD_PTX.replace("atom.global.sys.release.exch", "atom.global.gpu.release.exch")
    assert "missing flag raise" in allreduce_ptx_problem(gpu_flags)  # a .gpu flag is not seen by a peer GPU in order
    relaxed = _GOOD_PTX + "atom.global.sys.relaxed.exch.b64 %rd1, [ %rd2 + 0 ], %rd3;\n"
    assert "relaxed system-scope" in allreduce_ptx_problem(relaxed)
    assert "relaxed system-scope" in allreduce_ptx_problem(_GOOD_PTX + "atom.global.relaxed.sys.cas.b64 %rd1;\n")
    no_wait = _GOOD_PTX.replace("atom.global.acquire.sys.cas", "ld.volatile.global")
    assert "missing flag wait" in allreduce_ptx_problem(no_wait)  # polling alone orders nothing
    scalar = _GOOD_PTX.replace("st.global.v4.b32", "st.global.b16")
    assert "16-byte stores" in allreduce_ptx_problem(scalar)
    assert allreduce_ptx_problem(scalar.replace("ld.global.cg.v4.b32", "ld.global.cg.b16"), vectorised=False) == ""
    assert "CTA-scoped" in allreduce_ptx_problem(_GOOD_PTX + "atom.global.cta.acquire.b32 %r1, [ %rd1 ], 0;\n")


# ----------------------------------------------------------------------------- bench bookkeeping and CLI


def _rank(rank, ok=True, digest="d", us=10.0, extra=None):
    size = {"nbytes": 65536, "plan": "one-shot/n2/c4", "ok": ok, "digest": digest, "ours_us": us, "nccl_us": 20.0,
            "one_shot_us": us}
    size.update(extra or {})
    return {"rank": rank, "active": True, "reason": "ok", "probe": "8 us vs 15 us", "sizes": [size]}


def test_bench_merge_takes_the_slowest_rank_and_demands_agreement():
    from v4flash_bench.allreduce import format_table, merge_ranks

    wr = merge_ranks(2, [_rank(1, us=12.0), _rank(0, us=9.0)])
    s = wr.sizes[0]
    assert s.correct and s.ours_us == 12.0 and s.nccl_us == 20.0 and s.two_shot_us is None
    assert "1.67x" in format_table([wr])
    assert merge_ranks(2, [_rank(0), _rank(1, digest="other")]).sizes[0].correct is False  # bitwise disagreement
    bad = merge_ranks(2, [_rank(0), _rank(1, ok=False, extra={"detail": "graph==exact False"})]).sizes[0]
    assert bad.correct is False and "graph==exact False" in bad.detail
    assert merge_ranks(2, [_rank(0), _rank(1, extra={"ours_us": None})]).sizes[0].ours_us is None
    err = merge_ranks(2, [_rank(0), {"rank": 1, "error": "Traceback ..."}])
    assert err.error.startswith("rank 1") and "ERROR" in format_table([err])


def _cli(argv, capsys):
    from v4flash_pd.cli.main import main as pd_main

    with pytest.raises(SystemExit) as exc:
        pd_main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    return exc.value.code, out.out + out.err


def test_launcher_bench_allreduce_needs_two_gpus(monkeypatch, capsys):
    from v4flash_pd.cli import cmd_bench

    monkeypatch.setattr(cmd_bench.shutil, "which", lambda name: None)
    code, text = _cli(["bench", "--allreduce"], capsys)
    assert code == 1 and "at least 2 NVIDIA GPUs" in text and "fix:" in text and "Traceback" not in text


@pytest.mark.parametrize("rc,code,word", [(0, 0, ""), (1, 1, "p2p"), (2, 2, "refused")])
def test_launcher_bench_allreduce_runs_the_kernel_bench_with_the_options(monkeypatch, capsys, rc, code, word):
    from v4flash_pd.cli import cmd_bench

    class _Done:
        returncode, stdout = 0, "GPU 0: a\nGPU 1: b\nGPU 2: c\nGPU 3: d\n"

    calls = []
    monkeypatch.setattr(cmd_bench.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(cmd_bench.subprocess, "run", lambda *a, **k: _Done())
    monkeypatch.setattr(cmd_bench.subprocess, "call", lambda argv: calls.append(argv) or rc)
    got, text = _cli(["bench", "--allreduce", "--allreduce-args", "--worlds 4 --json 'a b.json'"], capsys)
    assert got == code and word in text
    assert calls == [[sys.executable, "-m", "v4flash_bench.allreduce", "--worlds", "4", "--json", "a b.json"]]
