"""GPU tests of the fused indexer logits (run on the H200): real shapes, CUDA graphs, upstream parity."""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.indexer import op as indexer
from v4flash_kernels.indexer.reference import IndexerCase, logits_error, make_indexer_inputs, reference_for

pytestmark = pytest.mark.gpu
TOL = 1e-4  # max |err| / max |logit|


def _ok(out, ref):
    e = logits_error(out, ref)
    assert not e["nan"] and e["inf_ok"] and e["rel_err"] <= TOL, e


@pytest.mark.parametrize("case", [
    IndexerCase(batch=1, width=512, lengths=[32768]),  # 128K context, full
    IndexerCase(batch=5, width=512, lengths=[1024, 9000, 1, 32768], pad_rows=1, table_pad="stale"),
    IndexerCase(batch=64, width=64, lengths=[4096, 77, 2500], table_pad="neg", weight_strided=True),
    IndexerCase(batch=3, width=40, heads=16, lengths=[2000, 0, 5000], max_seq_len=2500, seq_lens_2d=False),
], ids=["b1_full", "b5_mixed_pad", "b64_neg", "h16_ragged"])
def test_gpu_matches_reference_and_upstream(case):
    from v4flash_kernels.upstream import load_indexer

    kw = make_indexer_inputs(case, device="cuda")
    ref = reference_for(kw)
    poison = torch.full((case.batch, kw["max_seq_len"]), float("nan"), device="cuda")
    for cfg in indexer.CONFIGS:
        poison.fill_(float("nan"))
        out = indexer.run(kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["seq_lens"], kw["page_table"],
                          kw["max_seq_len"], config=cfg, out=poison)
        _ok(out, ref)
    ours = indexer.fp8_paged_mqa_logits(*kw.values())
    _ok(ours, ref)
    up = load_indexer().fp8_paged_mqa_logits_torch_sm120(*kw.values())
    _ok(up, ref)
    assert torch.equal(torch.isneginf(ours), torch.isneginf(up))


def test_gpu_cuda_graph_replay_follows_new_lengths_and_tables():
    """Captured once at a long length, replayed after seq_lens / page table / q change: still exact."""
    case = IndexerCase(batch=4, width=256, lengths=[16000, 3000, 1, 9000])
    kw = make_indexer_inputs(case, device="cuda", seed=1)
    fresh = make_indexer_inputs(IndexerCase(batch=4, width=256, lengths=[200, 16384, 7000, 0]),
                                device="cuda", seed=2)
    indexer.fp8_paged_mqa_logits(*kw.values())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = indexer.fp8_paged_mqa_logits(*kw.values())
    g.replay()
    torch.cuda.synchronize()
    _ok(out, reference_for(kw))
    n = min(kw["kvcache_fp8"].shape[0], fresh["kvcache_fp8"].shape[0])
    kw["kvcache_fp8"][:n].copy_(fresh["kvcache_fp8"][:n])
    fresh["page_table"].clamp_(max=n - 1)
    for key in ("q_fp8", "weight", "seq_lens", "page_table"):
        kw[key].copy_(fresh[key])
    g.replay()
    torch.cuda.synchronize()
    _ok(out, reference_for(kw))
