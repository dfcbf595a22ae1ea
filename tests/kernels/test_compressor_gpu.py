"""GPU tests of the fused compressor (run on the H200): production shapes, CUDA-graph capture and replay,
determinism, and agreement with fp64 and with upstream's own Triton statement of the step.

Every step is held to `reference.check_step` (the ring within the fp32 GEMV's bound, untouched rows bit
for bit; each completed window's stored token within its format's rounding plus the fp32 arithmetic's
bound; the scales among those the computation may pick; every other cache byte as it was). Upstream here
is `compressor.upstream`: `linear_bf16_fp32`'s torch GEMM, the wheel's HIP Triton compress and norm +
RoPE (+ Hadamard) wrappers (its JIT CUDA kernels need SGLang's CUDA JIT) and its non-fused Triton FP8
store, run on the same steps and held to the same bounds.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.compressor import op
from v4flash_kernels.compressor import reference as R
from v4flash_kernels.compressor import upstream as U
from v4flash_kernels.compressor.sglang_objects import objects

pytestmark = pytest.mark.gpu
KINDS = [(4, 512), (128, 512), (4, 128)]
IDS = ["c4", "c128", "indexer"]


def _fused(case) -> None:
    op.forward_unified(**objects(case))


def _check(case, step) -> dict:
    ref = R.step_ref(case)
    before = case["cache"].cpu().clone()
    step(case)
    torch.cuda.synchronize()
    ok, metrics, why = R.check_step(case, ref, case["state"], case["cache"], before)
    assert ok, (why, metrics)
    return metrics


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("ratio,hd", KINDS, ids=IDS)
def test_gpu_production_steps_match_fp64_and_upstream(ratio, hd, rows):
    """DeepSeek-V4-Flash's shapes (wkv_gate 2048 / 1024 / 512 x 4096, the pools' page sizes) on
    realistic rings; upstream's step on the same inputs passes the same check."""
    m = _check(R.make_case(rows, ratio, hd, 4096, seed=rows, device="cuda"), _fused)
    assert m["rows_completed"] >= (1 if rows < 3 else 2)
    _check(R.make_case(rows, ratio, hd, 4096, seed=rows, device="cuda"), U.step)


@pytest.mark.parametrize("ratio,hd", KINDS, ids=IDS)
def test_gpu_cuda_graph_capture_and_replay_follow_new_steps(ratio, hd):
    """Captured once as SGLang captures its decode graph (warm-up on a side stream), replayed on later
    steps copied into the captured buffers: positions advance, windows complete in other rows."""
    case = R.make_case(16, ratio, hd, 4096, seed=21, device="cuda")
    kw = objects(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op.forward_unified(**kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.forward_unified(**kw)
    for seed in (22, 23, 24):
        fresh = R.make_case(16, ratio, hd, 4096, seed=seed, device="cuda")
        for key, v in fresh.items():
            if torch.is_tensor(v):
                case[key].copy_(v)
        ref = R.step_ref(case)
        before = case["cache"].cpu().clone()
        graph.replay()
        torch.cuda.synchronize()
        ok, metrics, why = R.check_step(case, ref, case["state"], case["cache"], before)
        assert ok and metrics["rows_completed"] > 0, (seed, why, metrics)


@pytest.mark.parametrize("ratio,hd", KINDS, ids=IDS)
def test_gpu_deterministic_and_independent_of_the_batch(ratio, hd):
    """Bit for bit the same ring and cache run to run, and a row's result does not depend on the batch
    around it while the plan is the same: the plan is a function of the row count (CUDA-core dot up to
    FMA_ROWS rows, tensor-core dot above, each adding the K products in its own order), so a row is
    compared with itself in a smaller batch of the same plan (8 vs 5 rows, 4 vs 1)."""
    for big, small in ((8, op.FMA_ROWS + 1), (op.FMA_ROWS, 1)):
        assert op.plan_for(ratio, hd, 4096, big).mma == op.plan_for(ratio, hd, 4096, small).mma
        outs = []
        for _ in range(2):
            case = R.make_case(big, ratio, hd, 4096, seed=31, device="cuda")
            _fused(case)
            outs.append((case["state"].clone(), case["cache"].clone()))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        case = R.make_case(big, ratio, hd, 4096, seed=31, device="cuda")
        part = {k: (v[:small].contiguous() if torch.is_tensor(v) and k in ("x", "plan_d", "out_loc") else v)
                for k, v in case.items()}
        _fused(part)
        for row in range(small):
            w = int(case["plan_d"][row, 1])
            assert torch.equal(part["state"][w], outs[0][0][w]), (big, small, row)
            if int(case["plan_d"][row, 0]) % ratio == 0:
                loc = int(case["out_loc"][row])
                a = R.read_tokens(part["cache"], [loc], case["page_size"], hd)["raw"]
                b = R.read_tokens(outs[0][1], [loc], case["page_size"], hd)["raw"]
                assert torch.equal(a, b), (big, small, row)


def test_gpu_ring_matches_upstream_over_consecutive_steps():
    """A c4 ring through 6 consecutive steps of 16 requests, ours and upstream's side by side: rows never
    written stay identical, written rows within the two GEMMs' fp32 accumulation bound."""
    start = [4 * (3 + b) + b % 4 for b in range(16)]
    case = R.make_case(16, 4, 512, 4096, seed=41, device="cuda", seq_lens=start)
    up = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in case.items()}
    bound = torch.zeros(case["state"].shape, dtype=torch.float64)
    for step in range(6):
        plan = torch.tensor([R.plan_row(i, s + step, 4) for i, s in enumerate(start)], dtype=torch.int32)
        for c in (case, up):
            c["plan_d"].copy_(plan)
            c["x"].copy_((torch.randn(c["x"].shape, generator=torch.Generator().manual_seed(step))).to(torch.bfloat16))
        ref = R.step_ref(case)
        _fused(case)
        U.step(up)
        torch.cuda.synchronize()
        new = ref.state_bound.sum(1) > 0
        bound[new] = ref.state_bound[new]
        ours, theirs = case["state"].cpu().double(), up["state"].cpu().double()
        written = bound.sum(1) > 0
        assert torch.equal(ours[~written], theirs[~written]), step
        assert bool(((ours - theirs).abs() <= 2 * bound).all()), step


def test_gpu_plans_are_what_check_sm120_compiles():
    assert {p.name for p in op.launchable()} == {op.plan_for(r, d, 4096, t).name for r, d in KINDS for t in (1, 16)}
