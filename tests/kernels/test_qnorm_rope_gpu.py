"""GPU tests of the fused q path (run on the H200): DeepSeek-V4-Flash's wq_b at TP4 and TP2, CUDA graphs,
the unfused composition it replaces.

Every result is held to `reference.error_bound` around the fp64 reference (the tensor cores' fp8
accumulation, 2^-10 of the |terms| as in test_fp8_gemm_gpu, and a round-to-nearest bf16 at upstream's
three points). The composition the fusion replaces when wq_b is our linear, our block-FP8 linear then the
torch statement of upstream's JIT `fused_q_norm_rope` (the JIT kernel needs SGLang's CUDA JIT), runs on
the same inputs and is held to the same bound; the two may differ only by the GEMM's summation order
(and the bf16 roundings it flips).
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.qnorm_rope import op
from v4flash_kernels.qnorm_rope import reference as R
from v4flash_kernels.qnorm_rope import upstream as U
from v4flash_kernels.qnorm_rope.selfcheck import mqa_layer

pytestmark = pytest.mark.gpu
K = op.FUSED_K
EPS = 1e-6
CONTEXT = 131072
ROWS = [1, 2, 3, 4, 8, 12, 16]  # decode B and verify B x (k+1) rows the fused path takes


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.fixture(scope="module")
def freqs() -> torch.Tensor:
    return R.make_freqs_cis(CONTEXT, device="cuda")


def _inputs(m: int, heads: int, seed: int, freqs: torch.Tensor, pos_dtype=torch.int64):
    g = _gen(seed)
    x = R.make_activation(m, K, g, device="cuda")
    w, ws = R.make_weight(heads * 512, K, g, device="cuda")
    return x, w, ws, R.make_positions(m, freqs.shape[0], g, device="cuda", dtype=pos_dtype)


def _excess(out, x, w, ws, heads, freqs, pos) -> float:
    args = (x, w, ws, heads, EPS, freqs, pos)
    return R.excess(out, R.qnorm_rope_ref(*args), R.error_bound(*args))


def _layer(w, ws, heads, freqs):
    return mqa_layer(w, ws, heads, freqs, EPS)


@pytest.mark.parametrize("tp", [4, 2])
@pytest.mark.parametrize("m", ROWS)
def test_gpu_production_shapes_vs_fp64_and_the_unfused_composition(m, tp, freqs):
    heads, rank = 64 // tp, tp - 1
    x, w, ws, pos = _inputs(m, heads, 100 * tp + m, freqs)
    padded = torch.full((m, 64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    q_out = padded[:, rank * heads:(rank + 1) * heads]  # as MQALayer.forward slices it
    got = op.qnorm_rope(x, w, ws, heads, EPS, freqs, pos, q_out)
    torch.cuda.synchronize()
    assert got is q_out
    assert torch.isnan(padded[:, :rank * heads].float()).all()  # no other rank's head written
    ex = _excess(q_out, x, w, ws, heads, freqs, pos)
    assert ex <= 1.0, ex
    unfused = U.unfused(x, w, ws, heads, EPS, freqs, pos)
    ex_u = _excess(unfused, x, w, ws, heads, freqs, pos)
    assert ex_u <= 1.0, ex_u
    assert rel_err(q_out, unfused) <= 1e-2


@pytest.mark.parametrize("cfg", op.launchable(), ids=lambda c: c.name)
def test_gpu_every_compiled_config(cfg, freqs):
    """The sweep's candidates too; configs that differ only in their pipeline depth compute the same bits."""
    x, w, ws, pos = _inputs(16, 16, 7, freqs, pos_dtype=torch.int32)
    out = op.qnorm_rope(x, w, ws, 16, EPS, freqs, pos, config=cfg)
    assert _excess(out, x, w, ws, 16, freqs, pos) <= 1.0
    twin = next(c for c in op.launchable() if (c.block_k, c.num_warps) == (cfg.block_k, cfg.num_warps))
    assert torch.equal(out, op.qnorm_rope(x, w, ws, 16, EPS, freqs, pos, config=twin))


def test_gpu_deterministic_and_a_rows_result_does_not_depend_on_the_batch(freqs):
    x, w, ws, pos = _inputs(16, 16, 8, freqs)
    a = op.qnorm_rope(x, w, ws, 16, EPS, freqs, pos)
    for _ in range(3):
        assert torch.equal(a, op.qnorm_rope(x, w, ws, 16, EPS, freqs, pos))
    one = op.qnorm_rope(x[5:6].contiguous(), w, ws, 16, EPS, freqs, pos[5:6].contiguous())
    assert torch.equal(one[0], a[5])


@pytest.mark.parametrize("m", [1, 16])
def test_gpu_cuda_graph_of_the_drop_in_replays_on_new_inputs(m, freqs):
    """The drop-in as SGLang captures it (warm-up on a side stream, then capture), replayed on new q,
    positions and weights copied into the captured buffers."""
    heads = 16
    x, w, ws, pos = _inputs(m, heads, 9, freqs)
    layer = _layer(w, ws, heads, freqs)
    padded = torch.empty((m, 64, 512), dtype=torch.bfloat16, device="cuda")
    q_out = padded[:, 16:32]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op.compute_q_b(layer, x, pos, q_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op.compute_q_b(layer, x, pos, q_out)
    assert out is q_out
    for seed in (10, 11):
        x2, w2, ws2, pos2 = _inputs(m, heads, seed, freqs)
        for dst, src in ((x, x2), (w, w2), (ws, ws2), (pos, pos2)):
            dst.copy_(src)
        padded.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _excess(q_out, x, w, ws, heads, freqs, pos) <= 1.0
        assert torch.isnan(padded[:, :16].float()).all() and torch.isnan(padded[:, 32:].float()).all()


def test_gpu_selfcheck_passes_at_production_shapes():
    """The switch's self-check as `up` runs it on a decode GPU (TP4 rank 1, B=1 and 4, MTP verify rows 3 and
    12), with the CUDA-graph case and the unfused composition."""
    from v4flash_kernels.selfcheck.case import Target
    from v4flash_kernels.selfcheck.runner import Options, registry_modules, run

    t = Target(device="cuda", batches=(1, 4), verify_rows=(3, 12), tp_size=4, tp_rank=1, context=CONTEXT)
    rec = run(Options(target=t, patches=("qnorm_rope",), modules=registry_modules(("qnorm_rope",)), log=print))
    entry = rec["patches"]["qnorm_rope"]
    assert entry["status"] == "pass", entry
    prod = [c for c in entry["cases"] if c["size"] == "production"]
    assert {c["name"] for c in prod} >= {f"wq_b TP{tp} {64 // tp} heads T={m}" for tp in (4, 2) for m in (1, 3, 4, 12)}
    assert any(c["graph"] and c["graph"]["replays"] == 2 for c in prod)
    assert all(c["upstream"]["status"] == "pass" for c in entry["cases"])
