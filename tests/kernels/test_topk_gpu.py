"""GPU tests of the top-K transform (run on the H200): real shapes, CUDA graphs, determinism, upstream.

Exact against the integer reference (every slot of both outputs, poisoned first); against the
wheel's torch version of the op (`topk_transform_512_pytorch_vectorized`) as sets where the two
contracts agree (the JIT `topk_v1.cuh` itself needs SGLang's CUDA JIT).
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.topk import op as topk
from v4flash_kernels.topk.reference import POISON, TopkCase, make_topk_inputs, topk_transform_ref

pytestmark = pytest.mark.gpu
C4_128K = 32768  # c4 positions of a 128K-token configured context
C4_1M = 262144


def _exact(kw, **opts):
    kw["out_page_indices"].fill_(POISON)
    kw["out_raw_indices"].fill_(POISON)
    topk.run(**kw, **opts)
    torch.cuda.synchronize()
    want_pages, want_raw = topk_transform_ref(kw["scores"], kw["seq_lens"], kw["page_tables"],
                                              kw["out_page_indices"].shape[1], kw["page_size"])
    got_pages, got_raw = kw["out_page_indices"].cpu(), kw["out_raw_indices"].cpu()
    bad = [b for b in range(got_raw.shape[0])
           if not (torch.equal(got_raw[b], want_raw[b]) and torch.equal(got_pages[b], want_pages[b]))]
    assert not bad, f"rows {bad[:8]} differ (of {got_raw.shape[0]})"


def _prefill_lengths(tokens: int) -> list:
    return [(t + 1) // 4 for t in range(tokens)]


@pytest.mark.parametrize("case", [
    TopkCase(batch=1, width=C4_128K, lengths=[C4_128K]),  # B=1 at 128K, full
    TopkCase(batch=1, width=C4_128K, lengths=[2048]),  # B=1 at 128K configured, 8K actual
    TopkCase(batch=16, width=C4_128K, lengths=[C4_128K, 2048, 100, 513, 9000, 1, 4096, 4097, 20000, 1024]),
    TopkCase(batch=64, width=C4_128K, lengths=[C4_128K], pattern="cluster"),
    TopkCase(batch=64, width=C4_128K, lengths=[30000, 7000], pattern="relu", score_pad=16, table_pad=8),
    TopkCase(batch=2048, width=2048, lengths=_prefill_lengths(8192)[::4]),  # a prefill chunk's rows
    TopkCase(batch=3, width=C4_128K, lengths=[C4_128K, 5000, 1500], pattern="ties"),  # > CAP candidates
    TopkCase(batch=2, width=C4_128K, lengths=[C4_128K, 3000], pattern="sorted_up"),
    TopkCase(batch=1, width=C4_1M, lengths=[C4_1M]),  # 1M context: more tiles than one list step
    TopkCase(batch=4, width=16384, lengths=[16384, 1025, 1024, 3000], k=1024),
    TopkCase(batch=2, width=5000, lengths=[5000, 4000], page_size=1),  # table read at the end
], ids=["b1_128k_full", "b1_128k_8k", "b16_mixed", "b64_cluster", "b64_relu_strided", "prefill_8k_rows",
        "ties_fallback", "sorted", "b1_1m", "k1024", "page1"])
def test_gpu_matches_reference(case):
    _exact(make_topk_inputs(case, seed=1, device="cuda"))


def test_gpu_every_config_agrees():
    kw = make_topk_inputs(TopkCase(batch=9, width=C4_128K, lengths=[C4_128K, 2048, 700, 12000, 3]), seed=2,
                          device="cuda")
    for cfg in topk.CONFIGS + topk.SWEEP[:3]:
        _exact(kw, config=cfg)


def test_gpu_deterministic_and_same_at_any_batch_size():
    """Bitwise the same run to run, and a row's output does not depend on its batch or program count."""
    kw = make_topk_inputs(TopkCase(batch=64, width=C4_128K, lengths=[C4_128K, 9000, 2048]), seed=3, device="cuda")
    topk.run(**kw)
    first = (kw["out_page_indices"].clone(), kw["out_raw_indices"].clone())
    for _ in range(3):
        topk.run(**kw)
        assert torch.equal(kw["out_page_indices"], first[0]) and torch.equal(kw["out_raw_indices"], first[1])
    one = {k: (v[:1].contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    topk.run(**one)
    assert torch.equal(one["out_raw_indices"][0], first[1][0])
    topk.run(**kw, nprog=5)
    assert torch.equal(kw["out_raw_indices"], first[1])


def test_gpu_cuda_graph_replay_follows_new_lengths_and_scores():
    case = TopkCase(batch=16, width=C4_128K, lengths=[C4_128K, 2048, 300, 9000])
    kw = make_topk_inputs(case, seed=4, device="cuda")
    fresh = make_topk_inputs(TopkCase(batch=16, width=C4_128K, lengths=[100, C4_128K, 5000, 2049], pattern="cluster"),
                             seed=5, device="cuda")
    topk.topk_transform_512(*kw.values())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        topk.topk_transform_512(*kw.values())
    for src in (kw, fresh):
        for key in ("scores", "seq_lens", "page_tables"):
            kw[key].copy_(src[key])
        kw["out_page_indices"].fill_(POISON)
        kw["out_raw_indices"].fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        want_pages, want_raw = topk_transform_ref(kw["scores"], kw["seq_lens"], kw["page_tables"], 512, 64)
        assert torch.equal(kw["out_raw_indices"].cpu(), want_raw) and torch.equal(kw["out_page_indices"].cpu(),
                                                                                  want_pages)


def test_gpu_same_sets_as_upstream_torch_version():
    from v4flash_kernels.upstream import load_indexer

    kw = make_topk_inputs(TopkCase(batch=16, width=C4_128K, lengths=[C4_128K, 2048, 513, 300]), seed=6,
                          device="cuda")
    topk.run(**kw)
    up_pages, up_raw = torch.empty_like(kw["out_page_indices"]), torch.empty_like(kw["out_raw_indices"])
    load_indexer().topk_transform_512_pytorch_vectorized(kw["scores"], kw["seq_lens"], kw["page_tables"], up_pages,
                                                         64, up_raw)
    ours = torch.sort(kw["out_raw_indices"], dim=1).values
    theirs = torch.sort(up_raw, dim=1).values
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.sort(kw["out_page_indices"], dim=1).values, torch.sort(up_pages, dim=1).values)
