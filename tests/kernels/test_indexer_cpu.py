"""CPU tests of the fused indexer logits under TRITON_INTERPRET=1 (small shapes).

Every case is checked against the fp64 reference built from the raw page bytes AND against
upstream's `fp8_paged_mqa_logits_torch_sm120`, extracted verbatim from the pinned sglang wheel at
test time (it is plain torch and runs on CPU), on NaN-poisoned outputs so an unwritten element
cannot pass.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from v4flash_kernels.indexer import op as indexer
from v4flash_kernels.indexer.reference import IndexerCase, logits_error, make_indexer_inputs, reference_for
from v4flash_kernels.upstream import load_indexer

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)
TOL = 1e-5  # max |err| / max |logit|; fp32 accumulation of exact fp8 products


@pytest.fixture(scope="module")
def upstream():
    return load_indexer()


def _poisoned(kw, **opts):
    B, msl = kw["q_fp8"].shape[0], kw["max_seq_len"]
    poison = torch.full((B, msl), float("nan"), dtype=torch.float32)
    out = indexer.run(kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["seq_lens"], kw["page_table"], msl,
                      out=poison, **opts)
    assert out.data_ptr() == poison.data_ptr()
    return out


def _assert_close(out, ref):
    e = logits_error(out, ref)
    assert not e["nan"], "NaN (or unwritten) logit"
    assert e["inf_ok"], "-inf mask differs"
    assert e["rel_err"] <= TOL, e


CASES = {
    # SGLang's decode call: seq_lens [B, 1] int32, a CUDA-graph padding row (seq_len 1, table of 0s),
    # a row ending mid-page, a 1-position row, page-table columns past the lengths left at 0.
    "decode_pad_row": IndexerCase(batch=4, width=6, lengths=[300, 1, 129], pad_rows=1),
    # -1 in the table past the lengths (upstream's gather wraps it to the last page; never valid here),
    # a strided weight view, int64 seq_lens given as [B].
    "neg_table_strided_w": IndexerCase(batch=3, width=5, lengths=[70, 320, 64], table_pad="neg",
                                       weight_strided=True, seq_lens_2d=False, seq_dtype=torch.int64),
    # max_seq_len not a multiple of 64, extra table columns with stale pages, an empty row (seq_len 0),
    # a row longer than max_seq_len (clipped), 16 heads.
    "ragged_msl_stale": IndexerCase(batch=3, width=4, heads=16, lengths=[256, 0, 400], max_seq_len=250,
                                    extra_table_cols=3, table_pad="stale"),
    # fewer heads than the 16-wide dot block and a non-power-of-two count (masked head lanes).
    "heads_24": IndexerCase(batch=2, width=3, heads=24, lengths=[150, 192]),
    "heads_8": IndexerCase(batch=2, width=3, heads=8, lengths=[5, 191]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_fp64_reference_and_upstream(name, upstream):
    kw = make_indexer_inputs(CASES[name])  # fresh random inputs every run
    ref = reference_for(kw)
    out = _poisoned(kw)
    _assert_close(out, ref)
    up = upstream.fp8_paged_mqa_logits_torch_sm120(*kw.values())
    _assert_close(up, ref)  # the reference agrees with upstream's reading of the format
    assert out.dtype == up.dtype == torch.float32 and out.shape == up.shape
    assert torch.equal(torch.isneginf(out), torch.isneginf(up))
    fin = torch.isfinite(up)
    assert (out[fin] - up[fin]).abs().max() <= TOL * up[fin].abs().max()
    pub = indexer.fp8_paged_mqa_logits(*kw.values())  # the public entry, positional like SGLang's call
    assert torch.equal(pub, out)


@pytest.mark.parametrize("cfg", indexer.CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("nprog", [1, 2, 5])
def test_every_config_and_program_split_agree(cfg, nprog):
    """Programs walk tiles p, p+NPROG, ... and split the -inf tail: any split, same logits."""
    kw = make_indexer_inputs(IndexerCase(batch=2, width=9, heads=64, lengths=[500, 130]), seed=7)
    ref = reference_for(kw)
    _assert_close(_poisoned(kw, config=cfg, nprog=nprog), ref)


def test_key_scale_and_weight_are_per_token_and_per_head():
    """Scaling one token's fp32 scale or one head's weight moves exactly what it should."""
    kw = make_indexer_inputs(IndexerCase(batch=1, width=2, heads=16, lengths=[100]), seed=3)
    base = _poisoned(kw)
    page = int(kw["page_table"][0, 1])
    raw = kw["kvcache_fp8"].view(-1, 8448)
    scales = raw[page, 8192:].view(torch.float32)
    scales[5] *= 2.0  # position 64 + 5
    out = _poisoned(kw)
    changed = (out != base).nonzero().tolist()
    assert changed == [[0, 69]] and torch.allclose(out[0, 69], 2 * base[0, 69])
    kw["weight"][0, 3] += 1.0
    _assert_close(_poisoned(kw), reference_for(kw))


def test_signature_is_upstreams(upstream):
    ours = inspect.signature(indexer.fp8_paged_mqa_logits)
    theirs = inspect.signature(upstream.fp8_paged_mqa_logits_torch_sm120)
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()
    ]


@pytest.mark.parametrize("bad", ["clean_logits", "head_dim", "weight_shape", "seq_lens_shape", "page_rows"])
def test_rejects_what_upstream_rejects(bad, upstream):
    kw = make_indexer_inputs(IndexerCase(batch=2, width=2, heads=16, lengths=[10]), seed=1)
    if bad == "clean_logits":
        kw["clean_logits"] = True
    elif bad == "head_dim":
        kw["q_fp8"] = torch.zeros((2, 1, 16, 64), dtype=torch.float8_e4m3fn)
    elif bad == "weight_shape":
        kw["weight"] = kw["weight"][:, :8]
    elif bad == "seq_lens_shape":
        kw["seq_lens"] = kw["seq_lens"][:1]
    else:
        kw["page_table"] = kw["page_table"][:1]
    for fn in (indexer.fp8_paged_mqa_logits, upstream.fp8_paged_mqa_logits_torch_sm120):
        with pytest.raises(AssertionError):
            fn(*kw.values())


def test_too_narrow_page_table_fails_like_upstream(upstream):
    kw = make_indexer_inputs(IndexerCase(batch=1, width=2, heads=16, lengths=[10]), seed=1)
    kw["max_seq_len"] = 3 * 64
    for fn in (indexer.fp8_paged_mqa_logits, upstream.fp8_paged_mqa_logits_torch_sm120):
        with pytest.raises(RuntimeError):
            fn(*kw.values())


def test_topk_consumer_selects_the_same_positions(upstream):
    """Upstream's own torch top-k (what SGLANG_TOPK_TRANSFORM_512_TORCH runs) on our logits and on
    upstream's: the same pages, for long rows (radix path), short rows and padded rows."""
    kw = make_indexer_inputs(IndexerCase(batch=4, width=20, heads=64, lengths=[1200, 300, 700], pad_rows=1))
    ours = indexer.fp8_paged_mqa_logits(*kw.values())
    theirs = upstream.fp8_paged_mqa_logits_torch_sm120(*kw.values())
    seq = kw["seq_lens"].squeeze(-1)
    picks = []
    for logits in (ours, theirs):
        pages = torch.empty((4, 512), dtype=torch.int32)
        raw = torch.empty((4, 512), dtype=torch.int32)
        upstream.topk_transform_512_pytorch_vectorized(logits, seq, kw["page_table"], pages, 64, raw)
        picks.append((pages, raw))
    ref = reference_for(kw)
    for b in range(4):
        a = set(picks[0][1][b].tolist()) - {-1}
        u = set(picks[1][1][b].tolist()) - {-1}
        assert len(a) == len(u) == min(512, int(seq[b]))
        if a != u:  # only near-ties at the 512th value may swap
            kth = torch.topk(ref[b][: int(seq[b])], 512).values[-1].item()
            for p in a ^ u:
                assert abs(ref[b, p].item() - kth) <= 1e-5 * ref[b].abs().max().item()
    assert torch.equal(picks[0][0][3], picks[1][0][3])  # the padded row: page 0 slot 0, then -1


def test_empty_batch_and_zero_width():
    kw = make_indexer_inputs(IndexerCase(batch=1, width=1, heads=16, lengths=[10]), seed=1)
    kw0 = dict(kw, q_fp8=kw["q_fp8"][:0], weight=kw["weight"][:0], seq_lens=kw["seq_lens"][:0],
               page_table=kw["page_table"][:0])
    assert indexer.fp8_paged_mqa_logits(*kw0.values()).shape == (0, 64)
    assert indexer.fp8_paged_mqa_logits(*dict(kw, max_seq_len=0).values()).shape == (1, 0)


def test_grid_depends_on_shapes_only():
    """Programs per row: from B, table width and SM count (never from seq_lens), capped by tiles."""
    cfg = indexer.IndexerConfig(pages=1, num_warps=4, num_stages=2, ctas_per_sm=8)
    assert indexer.programs_per_row(1, 4096, 132, cfg) == 1056
    assert indexer.programs_per_row(64, 4096, 132, cfg) == 17
    assert indexer.programs_per_row(1, 3, 132, cfg) == 3
    assert indexer.programs_per_row(100000, 512, 132, cfg) == 1
    big = indexer.IndexerConfig(pages=1, num_warps=4, num_stages=1, ctas_per_sm=8, ctas_per_sm_big=16)
    assert indexer.programs_per_row(63, 4096, 132, big) == 17
    assert indexer.programs_per_row(64, 4096, 132, big) == 33


def test_negative_page_id_inside_the_length_reads_what_upstream_reads(upstream):
    """A -1 in a valid column: upstream's gather takes the pool's last page (torch indexing); so do we."""
    kw = make_indexer_inputs(IndexerCase(batch=2, width=3, heads=16, lengths=[150, 70]), seed=5)
    kw["page_table"][0, 1] = -1
    kw["page_table"][1, 0] = -2
    ref = reference_for(kw)
    out = _poisoned(kw)
    _assert_close(out, ref)
    _assert_close(upstream.fp8_paged_mqa_logits_torch_sm120(*kw.values()), ref)


@pytest.mark.timeout(600)
def test_shipped_configs_fit_sm120(tmp_path):
    """Every launchable indexer config cross-compiles for sm_120 within 101376 B of smem, no spills
    (a subprocess: under TRITON_INTERPRET=1 `triton.jit` gives interpreter objects)."""
    import json
    import subprocess
    import sys

    code = (
        "import json\n"
        "from dataclasses import asdict\n"
        "from v4flash_kernels.indexer.compile import compile_indexer\n"
        "from v4flash_kernels.indexer.op import CONFIGS\n"
        "print(json.dumps([dict(asdict(compile_indexer(c, 120)), ok=compile_indexer(c, 120).ok) for c in CONFIGS]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert [r["config"] for r in rows] == [c.name for c in indexer.CONFIGS]
    for r in rows:
        assert r["ok"] and r["shared_bytes"] <= 101376 and r["spill_stores"] == 0 and r["registers"] > 0, r


def test_dropped_prefetch_outside_the_shipped_kernel_still_matches_reference():
    """The register prefetch moved to kernels/scripts/indexer_variants.py: it still builds on the shipped
    kernel's helpers and gives the reference's logits for 1-, 2- and 4-page tiles and any program split."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "kernels" / "scripts" / "indexer_variants.py"
    spec = importlib.util.spec_from_file_location("_v4flash_script_indexer_variants", path)
    iv = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = iv
    spec.loader.exec_module(iv)
    kw = make_indexer_inputs(IndexerCase(batch=2, width=9, heads=64, lengths=[500, 130]), seed=7)
    ref = reference_for(kw)
    for cfg in (c for c in iv.CONFIGS if c.ctas_per_sm == 8):
        for nprog in (1, 5):
            rec = iv.check(kw, cfg, ref, nprog)
            assert rec["ok"] and rec["rel_err"] <= TOL, (cfg.name, nprog, rec)
