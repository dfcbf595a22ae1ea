"""IPC all-reduce on GPUs.

One GPU (`simulate.LocalRanks`): N buffers on the device stand in for the peers and N kernels on N
streams run the real flag protocol concurrently, checked bit for bit against the rank-order fp32 sum
(what every rank must return) and within half an ulp of the fp64 sum, eagerly and replayed from a
CUDA graph, 2 B to 8 MiB, for 2, 3, 4 and 8 ranks.

Several GPUs (skipped below 2): one process per GPU through the bench's rank worker, torch.distributed
(NCCL) vs ours for 2 B - 8 MiB at every rank count the machine has, eager and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.allreduce import plan as P
from v4flash_kernels.allreduce.reference import all_reduce_ref, max_ulp_error, rank_order_sum

# A protocol bug shows as kernels spinning for ever: the thread method ends the process (a signal
# would wait for the blocked CUDA call to return).
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180, method="thread")]

KB, MB = 1024, 1024 * 1024
SIZES = (2, 16, 258, 4 * KB, 16 * KB + 2, 64 * KB, 256 * KB, 1 * MB, 8 * MB)


def _ranks(world):
    from v4flash_kernels.allreduce.simulate import LocalRanks

    return LocalRanks(world)


def _inputs(world, numel, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.rand(numel, device="cuda", generator=g).to(dtype) for _ in range(world)]


def _check(outs, xs, dtype):
    want = rank_order_sum(xs, dtype)
    for r, o in enumerate(outs):
        assert torch.equal(o, want), f"rank {r}: not the rank-order fp32 sum"
    # the fp32 sum is exact or off by far less than a bf16 ulp: correctly rounded up to double rounding
    assert max_ulp_error(outs[0], all_reduce_ref(xs)) <= (0.5 + 2.0 ** -8 if dtype == torch.bfloat16 else len(xs) / 2 + 0.5)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_simulated_ranks_every_size_auto_plan(world):
    lr = _ranks(world)
    for i, nbytes in enumerate(SIZES):
        xs = _inputs(world, max(1, nbytes // 2), torch.bfloat16, i)
        _check(lr.all_reduce(xs), xs, torch.bfloat16)
    torch.cuda.synchronize()
    assert lr.epochs() == [len(SIZES)] * world


@pytest.mark.parametrize("two_shot", [False, True])
@pytest.mark.parametrize("world", [3, 4])
def test_simulated_ranks_forced_algorithms_and_grids(world, two_shot):
    lr = _ranks(world)
    for nbytes, ctas in ((2, None), (4 * KB + 2, 3), (64 * KB, None), (300 * KB, 7), (2 * MB, None)):
        xs = _inputs(world, nbytes // 2, torch.bfloat16, nbytes)
        _check(lr.all_reduce(xs, two_shot=two_shot, ctas=ctas), xs, torch.bfloat16)


def test_simulated_ranks_fp32_and_in_place():
    lr = _ranks(4)
    for numel in (1, 1000, 70_000, 2 * MB // 4):
        xs = _inputs(4, numel, torch.float32, numel)
        _check(lr.all_reduce(xs), xs, torch.float32)
    xs = _inputs(4, 32 * KB, torch.bfloat16, 5)
    ref = [x.clone() for x in xs]
    lr.all_reduce(xs, xs)  # out is the input, as SGLang's in-place call
    _check(xs, ref, torch.bfloat16)


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_in_a_cuda_graph_replayed_with_new_inputs(world):
    """One graph holds calls of several sizes and both algorithms; each replay advances the epochs
    on the GPU (no host reset), so replays alternate buffer halves and must stay exact."""
    lr = _ranks(world)
    sizes = (2, 16 * KB, 64 * KB + 2, 1 * MB)
    xs = {n: _inputs(world, n // 2, torch.bfloat16, n) for n in sizes}
    outs = {n: [torch.empty_like(x) for x in xs[n]] for n in sizes}
    for n in sizes:  # compile outside capture
        lr.all_reduce(xs[n], outs[n])
    torch.cuda.synchronize()
    before = lr.epochs()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for n in sizes:
            lr.all_reduce(xs[n], outs[n])
        lr.all_reduce(xs[sizes[1]], outs[sizes[1]], two_shot=True)
    for rep in range(3):
        for n in sizes:
            for r, x in enumerate(xs[n]):
                x.copy_(_inputs(world, n // 2, torch.bfloat16, 1000 * rep + 10 * r + n)[r])
        g.replay()
        lr.all_reduce(xs[sizes[0]], outs[sizes[0]])  # an eager call between replays keeps the epochs in step
        torch.cuda.synchronize()
        for n in sizes:
            _check(outs[n], xs[n], torch.bfloat16)
    assert lr.epochs() == [before[0] + 3 * (len(sizes) + 2)] * world


def test_ptx_of_the_shipped_kernels_has_the_protocols_scopes():
    """On the GPU's own arch: what check_sm120 asserts for sm_120/sm_90 holds for the binary run here."""
    from v4flash_kernels.allreduce import kernel as k
    from v4flash_kernels.allreduce.compile import allreduce_ptx_problem

    lr = _ranks(2)
    xs = _inputs(2, 8 * KB, torch.bfloat16, 0)
    lr.all_reduce(xs, two_shot=False)
    lr.all_reduce(xs, two_shot=True)
    torch.cuda.synchronize()
    for fn in (k.one_shot_kernel, k.two_shot_kernel):
        compiled = [c for cache in fn.device_caches.values() for c in cache[0].values()]
        assert compiled, fn
        for c in compiled:  # every variant this process built (odd sizes: scalar accesses, same scopes)
            assert allreduce_ptx_problem(c.asm["ptx"], vectorised=False) == "", fn
        assert any(allreduce_ptx_problem(c.asm["ptx"]) == "" for c in compiled), fn  # the 8 KB one: 16-byte


# ----------------------------------------------------------------------------- several GPUs


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.timeout(900, method="thread")
@pytest.mark.skipif(_gpus() < 2, reason="needs >= 2 GPUs (a multi-GPU machine kind): one process per GPU")
@pytest.mark.parametrize("world", list(range(2, min(_gpus(), P.MAX_RANKS) + 1)) or [2])
def test_multi_gpu_matches_nccl_eager_and_in_a_graph(world):
    from v4flash_bench.allreduce import SIZES as BENCH_SIZES
    from v4flash_bench.allreduce import run_world

    wr = run_world(world, BENCH_SIZES + (3, 4 * KB + 2), "bfloat16", timing=False)
    assert not wr.error, wr.error
    assert wr.active, f"the communicator fell back to NCCL: {wr.reason}"
    checked = [s for s in wr.sizes if s.correct is not None]
    assert len(checked) == len(wr.sizes), [s.detail for s in wr.sizes]
    bad = [(s.nbytes, s.detail) for s in checked if not s.correct]
    assert not bad, bad
