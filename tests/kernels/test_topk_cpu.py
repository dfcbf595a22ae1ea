"""CPU tests of the top-K transform under TRITON_INTERPRET=1 (small shapes, every code path).

Every case is checked exactly (both outputs, every slot, on outputs poisoned with -7) against the
integer reference written from the definition (`topk.reference`). Upstream's function is the
JIT `topk_v1.cuh` (CUDA only), so the comparison with upstream in the same run is against the
wheel's own torch re-statement of the op, `topk_transform_512_pytorch_vectorized` (what
SGLANG_TOPK_TRANSFORM_512_TORCH runs), extracted verbatim at test time: the same selected sets
where both contracts agree, and the one documented difference (the torch version marks a -inf
score -1, the JIT kernel selects it like any other) pinned down.
"""

from __future__ import annotations

import inspect
import os
import zlib

import pytest
import torch

from v4flash_kernels import upstream as _up
from v4flash_kernels.topk import op as topk
from v4flash_kernels.topk.reference import POISON, TopkCase, make_topk_inputs, output_rank, topk_transform_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)
INF = float("inf")
NAN = float("nan")
TOPK_PATH = "sglang/jit_kernel/dsv4/topk.py"


@pytest.fixture(scope="module")
def upstream():
    return _up.load_indexer()


def _run(kw, **opts):
    topk.run(**kw, **opts)
    return kw["out_page_indices"], kw["out_raw_indices"]


def _ref(kw):
    return topk_transform_ref(kw["scores"], kw["seq_lens"], kw["page_tables"], kw["out_page_indices"].shape[1],
                              kw["page_size"])


def _assert_exact(kw, **opts):
    pages, raw = _run(kw, **opts)
    want_pages, want_raw = _ref(kw)
    assert not bool((pages == POISON).any()) and not bool((raw == POISON).any()), "a slot was not written"
    for b in range(pages.shape[0]):
        assert torch.equal(raw[b], want_raw[b]), (b, raw[b][:16].tolist(), want_raw[b][:16].tolist())
        assert torch.equal(pages[b], want_pages[b]), b


CASES = {
    # decode: a padding row (seq_len 1), exactly K, K + 1, exactly 2K (one tile of 2 rows), 3000
    # (4-row tile, column-major order), a table row wider than needed
    "decode_mixed": TopkCase(batch=6, width=3000, lengths=[3000, 513, 512, 1, 2048, 700]),
    # long rows: > 4K positions take the (column, tile) list path; 20000 leaves a partial last tile
    "long_rows": TopkCase(batch=3, width=20000, lengths=[20000, 16384, 4097]),
    # a contiguous run of high scores (the recent context), strided storage, big pages
    "cluster_strided": TopkCase(batch=2, width=9000, lengths=[9000, 5000], pattern="cluster", score_pad=37,
                                table_pad=3, page_size=256),
    # monotone rows (every column max grows with the row), relu'd scores with many exact zeros
    "sorted_up": TopkCase(batch=2, width=5000, lengths=[5000, 2500], pattern="sorted_up"),
    "sorted_down": TopkCase(batch=1, width=5000, lengths=[5000], pattern="sorted_down"),
    "relu_zeros": TopkCase(batch=2, width=4000, lengths=[4000, 1500], pattern="relu"),
    # keys equal in the high bits (radix passes that keep one bin full)
    "tight": TopkCase(batch=1, width=3000, lengths=[3000], pattern="tight"),
    # heavy ties: more than CAP candidates, so the row itself is selected from (and ties by order)
    "ties": TopkCase(batch=2, width=6000, lengths=[6000, 1100], pattern="ties"),
    "const": TopkCase(batch=2, width=3000, lengths=[3000, 2500], pattern="const"),
    # K = 1024 (upstream's other JIT instantiation)
    "k1024": TopkCase(batch=3, width=5000, lengths=[5000, 1025, 1024], k=1024),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name):
    _assert_exact(make_topk_inputs(CASES[name], seed=zlib.crc32(name.encode()) % 1000))


def test_inf_nan_and_signed_zero():
    """-inf in the prefix is a position like any other (200 finite scores: 312 -inf are selected,
    first in output order); +inf and a positive NaN rank on top, a negative NaN at the bottom, -0.0
    below +0.0."""
    kw = make_topk_inputs(TopkCase(batch=2, width=2100, lengths=[1000, 2100], pattern="relu"), seed=3)
    sc = kw["scores"]
    sc[0, 200:1000] = -INF
    sc[1] = torch.where(sc[1] > 0, sc[1], torch.full_like(sc[1], -0.0))
    sc[1, 5], sc[1, 9], sc[1, 2001] = INF, NAN, 0.0
    sc[1, 11] = torch.tensor([-1], dtype=torch.int32).view(torch.float32)  # NaN, sign bit set
    _assert_exact(kw)
    raw = kw["out_raw_indices"]
    assert sum(1 for p in raw[0].tolist() if p >= 200) == 312
    assert {5, 9, 2001} <= set(raw[1].tolist()) and 11 not in raw[1].tolist()


def test_seq_len_edges():
    """Empty and negative rows (all -1); a row <= K keeps upstream's sequential fill; seq_len past
    the width selects among the width; table columns past the table read as 0."""
    kw = make_topk_inputs(TopkCase(batch=6, width=600, lengths=[0, -5, 500, 10_000, 601, 513], table_cols=5),
                          seed=4)
    _assert_exact(kw)
    raw, pages = kw["out_raw_indices"], kw["out_page_indices"]
    assert bool((raw[:2] == -1).all()) and bool((pages[:2] == -1).all())
    assert raw[2, :500].tolist() == list(range(500)) and bool((raw[2, 500:] == -1).all())
    assert max(raw[3].tolist()) < 600 and max(raw[4].tolist()) < 600
    assert pages[2, 400].item() == 400 % 64  # column 6 is past the 5-column table: page 0
    narrow = make_topk_inputs(TopkCase(batch=1, width=300, lengths=[480]), seed=5)
    _assert_exact(narrow)  # seq_len 480 > width 300 but <= K: positions 0..479, no score read
    assert narrow["out_raw_indices"][0, :480].tolist() == list(range(480))


@pytest.mark.parametrize("page_size", [1, 2, 64, 4096])
def test_page_sizes_and_wrapping(page_size):
    """page_size 1 needs more table columns than the kernel prefetches (read at the end instead);
    huge page ids wrap in int32 as upstream's shift does."""
    case = TopkCase(batch=2, width=2500, lengths=[2500, 300], page_size=page_size)
    kw = make_topk_inputs(case, seed=6)
    kw["page_tables"][:, ::3] = (1 << 30) + 7
    _assert_exact(kw)


def test_output_order_is_column_major():
    kw = make_topk_inputs(TopkCase(batch=3, width=5000, lengths=[5000, 2048, 1024]), seed=7)
    _, raw = _run(kw)
    for b in range(3):
        r = output_rank(raw[b].long(), 512)
        assert bool((r[1:] > r[:-1]).all())
    assert not bool((raw[1][1:] > raw[1][:-1]).all())
    assert bool((raw[2][1:] > raw[2][:-1]).all())  # <= 2K = 1024 scores: ascending position


def test_persistent_programs_and_configs_agree():
    """Fewer programs than rows (each walks several rows, reusing its workspaces), other configs."""
    case = TopkCase(batch=5, width=6000, lengths=[6000, 100, 3000, 5000, 1500], pattern="cluster")
    base = make_topk_inputs(case, seed=8)
    want = _ref(base)
    for opts in ({"nprog": 2}, {"nprog": 1}, {"config": topk.TopkConfig(num_warps=4, cap=512, small=8)}):
        kw = make_topk_inputs(case, seed=8)
        pages, raw = _run(kw, **opts)
        assert torch.equal(raw, want[1]) and torch.equal(pages, want[0]), opts


def test_no_speculative_load_for_big_batches():
    """B > SPEC_MAX_ROWS: the first tile is loaded after seq_len, same result (prefill-like rows)."""
    B = topk.SPEC_MAX_ROWS + 3
    lens = [(t + 1) * 37 % 2600 for t in range(B)]
    kw = make_topk_inputs(TopkCase(batch=B, width=2600, lengths=lens), seed=9)
    _assert_exact(kw, nprog=4)


def test_without_raw_output():
    kw = make_topk_inputs(TopkCase(batch=2, width=3000, lengths=[3000, 20]), seed=10)
    kw["out_raw_indices"] = None
    topk.topk_transform_512(*kw.values())
    want_pages, _ = _ref(kw)
    assert torch.equal(kw["out_page_indices"], want_pages)


def test_same_sets_as_upstream_torch_version(upstream):
    """Where the contracts agree (no -inf in the prefix, no ties at the K-th): the same pages and
    positions as the wheel's torch top-k, as sets (its order is torch.topk's, unspecified)."""
    case = TopkCase(batch=5, width=4000, lengths=[4000, 2000, 513, 300, 1], page_size=64)
    kw = make_topk_inputs(case, seed=11)
    pages, raw = _run(kw)
    up_pages = torch.full_like(pages, POISON)
    up_raw = torch.full_like(raw, POISON)
    upstream.topk_transform_512_pytorch_vectorized(kw["scores"], kw["seq_lens"], kw["page_tables"], up_pages, 64,
                                                   up_raw)
    for b in range(case.batch):
        assert sorted(raw[b].tolist()) == sorted(up_raw[b].tolist()), b
        assert sorted(pages[b].tolist()) == sorted(up_pages[b].tolist()), b
    assert torch.equal(raw[3], up_raw[3]) and torch.equal(pages[4], up_pages[4])  # short rows: sequential


def test_neg_inf_differs_from_upstream_torch_version_as_documented(upstream):
    """The JIT kernel (and this op) select a -inf score like any other; the torch version writes -1."""
    kw = make_topk_inputs(TopkCase(batch=1, width=1000, lengths=[1000]), seed=12)
    kw["scores"][0, 200:] = -INF
    _, raw = _run(kw)
    up_pages, up_raw = torch.zeros_like(raw), torch.zeros_like(raw)
    upstream.topk_transform_512_pytorch_vectorized(kw["scores"], kw["seq_lens"], kw["page_tables"], up_pages, 64,
                                                   up_raw)
    assert not bool((raw == -1).any()) and int((up_raw == -1).sum()) == 312  # 200 finite, 312 -inf slots
    assert sorted(p for p in raw[0].tolist() if p < 200) == sorted(p for p in up_raw[0].tolist() if p >= 0)


def _upstream_topk_module():
    prelude = "from typing import Optional\n\nimport torch\n"
    return _up.load_defs(TOPK_PATH, ("topk_transform_512",), prelude)


def test_signature_is_upstreams():
    theirs = inspect.signature(_upstream_topk_module().topk_transform_512)
    ours = inspect.signature(topk.topk_transform_512)
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()
    ]


@pytest.mark.parametrize("bad", ["k", "scores_dtype", "scores_stride", "seq_dtype", "seq_shape", "table_dtype",
                                 "out_noncontig", "raw_shape", "page_size"])
def test_rejects_what_upstream_rejects(bad):
    kw = make_topk_inputs(TopkCase(batch=2, width=800, lengths=[800, 10]), seed=13)
    exc = RuntimeError
    if bad == "k":
        kw["out_page_indices"] = kw["out_page_indices"][:, :256].contiguous()
        exc = AssertionError
    elif bad == "scores_dtype":
        kw["scores"] = kw["scores"].half()
    elif bad == "scores_stride":
        kw["scores"] = kw["scores"].t().contiguous().t()
    elif bad == "seq_dtype":
        kw["seq_lens"] = kw["seq_lens"].long()
    elif bad == "seq_shape":
        kw["seq_lens"] = kw["seq_lens"].unsqueeze(-1)
    elif bad == "table_dtype":
        kw["page_tables"] = kw["page_tables"].long()
    elif bad == "out_noncontig":
        kw["out_page_indices"] = torch.zeros((512, 2), dtype=torch.int32).t()
    elif bad == "raw_shape":
        kw["out_raw_indices"] = kw["out_raw_indices"][:1]
    else:
        kw["page_size"] = 48
    with pytest.raises(exc):
        topk.topk_transform_512(*kw.values())


def test_empty_batch_is_a_no_op(monkeypatch):
    """No rows: the call's arguments are still checked, nothing is launched and nothing returned (the
    sentinel in place of the kernel proves the one-row call would have launched it)."""
    kw = make_topk_inputs(TopkCase(batch=1, width=600, lengths=[600]), seed=14)
    kw0 = {k: (v[:0] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"launched the top-K kernel on grid {grid}")

    monkeypatch.setattr(topk._k, "topk_transform_kernel", NoLaunch())
    assert topk.topk_transform_512(*kw0.values()) is None
    assert all(v.numel() == 0 for v in kw0.values() if isinstance(v, torch.Tensor))
    with pytest.raises(RuntimeError, match="page_size"):  # an empty call is still checked like any other
        topk.topk_transform_512(*dict(kw0, page_size=48).values())
    with pytest.raises(AssertionError, match="launched the top-K kernel"):
        topk.topk_transform_512(*kw.values())


def test_plan_depends_on_shapes_only():
    cfg = topk.TopkConfig(num_warps=8, ctas_per_sm=1)
    assert topk.programs(1, 132, cfg) == 1
    assert topk.programs(64, 132, cfg) == 64
    assert topk.programs(8192, 132, cfg) == 132
    assert topk.programs(8192, 132, topk.TopkConfig(num_warps=4, ctas_per_sm=2)) == 264
    assert topk.table_prefetch(32768, 512, 6) == 512  # 128K context, c4 pages of 64
    assert topk.table_prefetch(2048, 512, 6) == 32
    assert topk.table_prefetch(100, 512, 6) == 32  # covers positions < K of short rows
    assert topk.table_prefetch(2048, 1024, 6) == 0  # K = 1024 reads the table at the end
    assert topk.table_prefetch(32768, 512, 0) == 0  # 32768 columns: read at the end instead


@pytest.mark.timeout(600)
def test_shipped_configs_fit_sm120(tmp_path):
    """Every launchable top-K binary cross-compiles for sm_120 within 101376 B of smem, no spills
    (a subprocess: under TRITON_INTERPRET=1 `triton.jit` gives interpreter objects)."""
    import json
    import subprocess
    import sys

    code = (
        "import json\n"
        "from dataclasses import asdict\n"
        "from v4flash_kernels.topk.compile import binaries as check_topk\n"
        "print(json.dumps([dict(asdict(r), ok=r.ok) for r in check_topk(120)]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert {r["config"].split("/")[0] for r in rows} == {c.name for c in topk.CONFIGS}
    for r in rows:
        assert r["ok"] and r["shared_bytes"] <= 101376 and r["spill_stores"] == 0 and r["registers"] > 0, r


def test_bench_shapes_and_one_row_under_the_interpreter(upstream):
    """The benchmark's shapes (SGLang's c4 widths and lengths) and one checked row, timer stubbed."""
    import v4flash_bench.topk as bench

    labels = [s.label for s in bench.shapes_for([1, 64], ["128K"], ["8K", "full"], ["8K"])]
    assert labels == ["B=1 ctx=128K actual=8K", "B=1 ctx=128K actual=full", "B=64 ctx=128K actual=8K",
                      "B=64 ctx=128K actual=full", "prefill T=8192"]
    sh = bench.Shape("decode", 2, "16K", "8K")
    assert (sh.width, sh.lengths()) == (4096, [2048, 2048])
    assert bench.Shape("prefill", 1024, "1K", "-").width == 256
    row = bench.run_shape(sh, upstream.topk_transform_512_pytorch_vectorized, None, "unavailable", 3, device="cpu",
                          timer=lambda fn: (fn(), 1.0)[1])
    assert {n: v["ok"] for n, v in row["variants"].items()} == {"ours": True, "proxy": True, "torch": True,
                                                                "jit": True}
    assert row["variants"]["ours"]["exact"] and not row["variants"]["torch"]["exact"]
