"""CPU tests of the sparse-MLA decode kernels under TRITON_INTERPRET=1 (small shapes).

Every check compares against the fp64 reference built from the raw fp8_ds_mla bytes, with the
kernel's outputs poisoned (NaN) beforehand so an unwritten element cannot pass.
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch

from v4flash_kernels.attention import op as decode
from v4flash_kernels.attention.reference import (
    CacheSpec,
    Case,
    dequant_tokens,
    make_cache,
    make_inputs,
    page_stride,
    sparse_mla_decode_ref,
)
from v4flash_kernels.kit.compare import rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)


def _call(kw, plan=None):
    B, _, H, D = kw["q"].shape
    out = torch.full((B, 1, H, D), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((B, 1, H), float("nan"), dtype=torch.float32)
    o, lse_t = decode.run(
        kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"], kw["softmax_scale"],
        kw.get("extra_k_cache"), kw.get("extra_indices"), kw.get("extra_topk_length"),
        plan=plan, out=out, lse=lse,
    )
    assert o.data_ptr() == out.data_ptr() and lse_t.shape == (B, H, 1)
    return o, lse_t


def _assert_matches(kw, out, lse):
    ref_out, ref_lse = sparse_mla_decode_ref(**kw)
    assert not torch.isnan(out.float()).any(), "NaN (or unwritten) output element"
    assert not torch.isnan(lse).any(), "NaN (or unwritten) lse element"
    assert rel_err(out, ref_out) <= 1e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-3
    empty = ref_out.abs().amax(dim=(1, 3)) == 0  # [B, H]
    assert torch.all(out.float().amax(dim=(1, 3)).abs()[empty] == 0)
    return ref_out, ref_lse


CASES = {
    # c128-like: SWA page 64 + dense extra cache with page 2; B=3 (non power of two) with one
    # empty row and one short row, -1 holes, sink, uint8 cache.
    "c128_b3_sink_uint8": Case(batch=3, heads=16, width=64, page_size=64, extra_width=128,
                               extra_page_size=2, extra_dense=True, hole_frac=0.1),
    # SWA-only layer, float8 view of the cache, no sink, B=1.
    "swa_b1_fp8_nosink": Case(batch=1, heads=16, width=64, page_size=256, sink=False, fp8_view=True),
    # c4-like random top-k with duplicated indices (each occurrence counts), B=5, fp8 views.
    "c4_b5_dups_fp8": Case(batch=5, heads=16, width=64, page_size=64, extra_width=64, extra_page_size=64,
                           dup_frac=0.2, fp8_view=True),
    # Fewer heads than the 16-head block (masked rows), 8 heads like TP8.
    "c4_b2_h8": Case(batch=2, heads=8, width=64, page_size=64, extra_width=64, extra_page_size=64),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_fp64_reference(name):
    kw = make_inputs(CASES[name])  # fresh random inputs every run
    out, lse = _call(kw)
    ref_out, _ = _assert_matches(kw, out, lse)
    if CASES[name].batch > 2 and CASES[name].short_rows:
        assert ref_out[2].abs().max() == 0  # the empty row really is empty (the check is live)


def test_public_entry_returns_upstream_layout():
    kw = make_inputs(CASES["c128_b3_sink_uint8"])
    out, lse = decode.sparse_mla_decode(**kw)
    assert out.shape == (3, 1, 16, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 16, 1) and lse.dtype == torch.float32
    _assert_matches(kw, out, lse)


def test_all_rows_empty_gives_zeros_and_sink_lse():
    case = Case(batch=2, heads=16, width=64, page_size=64, extra_width=64, extra_page_size=64)
    kw = make_inputs(case)
    kw["topk_length"].zero_()
    kw["extra_topk_length"].zero_()
    out, lse = _call(kw)
    assert torch.all(out.float() == 0)
    assert torch.allclose(lse[:, :, 0], kw["attn_sink"].expand(2, 16))
    kw["attn_sink"] = None
    out, lse = _call(kw)
    assert torch.all(out.float() == 0) and torch.all(torch.isneginf(lse))


def test_no_topk_length_attends_whole_width():
    kw = make_inputs(Case(batch=2, heads=16, width=64, page_size=64, extra_width=64, extra_page_size=64,
                          short_rows=False))
    kw["topk_length"] = None
    kw["extra_topk_length"] = None
    out, lse = _call(kw)
    _assert_matches(kw, out, lse)


def test_topk_length_shorter_than_width_ignores_tail():
    """Entries past topk_length are ignored even when they hold valid slots."""
    kw = make_inputs(Case(batch=2, heads=16, width=64, page_size=64, short_rows=False, hole_frac=0.0))
    kw["topk_length"] = torch.tensor([64, 10], dtype=torch.int32)
    out, lse = _call(kw)
    ref_out, _ = _assert_matches(kw, out, lse)
    kw_full = dict(kw, topk_length=torch.tensor([64, 64], dtype=torch.int32))
    full_out, _ = sparse_mla_decode_ref(**kw_full)
    assert rel_err(ref_out[1], full_out[1]) > 0.1  # the truncation matters for this row


@pytest.mark.parametrize("cfg", decode.SPLIT_CONFIGS, ids=lambda c: c.name)
def test_every_shipped_config_and_split_count(cfg):
    case = Case(batch=2, heads=16, width=64, page_size=64, extra_width=128, extra_page_size=2,
                extra_dense=True)
    kw = make_inputs(case)
    ref_out, _ = sparse_mla_decode_ref(**kw)
    for min_tiles in (1, 8):  # many 1-tile splits, then one split per cache
        plan = decode.make_plan(2, 16, 64, 128, num_sms=4, config=cfg, min_tiles=min_tiles)
        out, lse = _call(kw, plan)
        _assert_matches(kw, out, lse)


def test_plan_depends_only_on_shapes_and_covers_widths():
    for B in (1, 3, 4, 16, 64):
        for H in (8, 16, 64):
            for w, w2 in ((128, 0), (128, 512), (128, 2048), (192, 1024)):
                p = decode.make_plan(B, H, w, w2, num_sms=132)
                assert p == decode.make_plan(B, H, w, w2, num_sms=132)
                assert p.chunk % p.config.block_t == 0
                assert p.splits_main * p.chunk >= w and (p.splits_main - 1) * p.chunk < w
                if w2:
                    assert p.splits_extra * p.chunk >= w2 and (p.splits_extra - 1) * p.chunk < w2
                else:
                    assert p.splits_extra == 0
                assert 1 <= p.num_splits <= decode.MAX_SPLITS
    # B=1 is split finely (fills the GPU), B=64 coarsely (no wasted partials).
    assert decode.make_plan(1, 64, 128, 512, 132).num_splits == 20
    assert decode.make_plan(64, 64, 128, 512, 132).num_splits <= 6


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_signature_matches_upstream():
    """Upstream's parameters exactly, then only keyword-only extras with defaults; the TP adapter exactly."""
    from v4flash_kernels.hook.tp_heads import make_tp_aware
    from v4flash_kernels.upstream import load_upstream

    up = _params(load_upstream().flash_mla_sparse_decode_triton)
    ours = _params(decode.sparse_mla_decode)
    assert ours[: len(up)] == up
    assert [(n, d, k) for n, d, k in ours[len(up):]] == [("head_range", None, inspect.Parameter.KEYWORD_ONLY)]
    assert _params(make_tp_aware(decode.sparse_mla_decode)) == up


def test_reference_dequant_reads_real_layout():
    """One hand-written token: fp8 1.0 x 2^(130-127) in group 3, bf16 RoPE -2.5, in page 1 slot 1."""
    cache = make_cache(CacheSpec(num_pages=2, page_size=2))
    pb = page_stride(2)
    assert cache.stride(0) == pb == 1728 and pb != 2 * 584
    flat = cache.as_strided((2 * pb,), (1,))
    tok = pb + 1 * 576
    flat[tok : tok + 448] = 0
    flat[tok + 3 * 64 + 5] = 0x38  # e4m3 1.0
    rope = torch.zeros(64, dtype=torch.bfloat16)
    rope[7] = -2.5
    flat[tok + 448 : tok + 576] = rope.view(torch.uint8)
    flat[pb + 2 * 576 + 8 : pb + 2 * 576 + 15] = torch.tensor([127, 127, 127, 130, 127, 127, 127], dtype=torch.uint8)
    v = dequant_tokens(cache, torch.tensor([3]))[0]  # slot 3 = page 1, offset 1
    assert v[3 * 64 + 5] == 8.0 and v[448 + 7] == -2.5
    assert torch.count_nonzero(v) == 2


def test_rejects_misaligned_page_stride():
    kw = make_inputs(Case(batch=1, heads=16, width=64, page_size=64))
    pool = torch.zeros(4, 64 * 584 + 8, dtype=torch.uint8)
    kw["k_cache"] = pool[:, : 64 * 584].view(4, 64, 1, 584)
    with pytest.raises(ValueError, match="page stride"):
        decode.sparse_mla_decode(**kw)


def test_sink_scales_output_and_lse():
    """A sink comparable to the row's lse halves the output; checked against the reference."""
    case = Case(batch=1, heads=16, width=64, page_size=64, extra_width=64, extra_page_size=64)
    kw = make_inputs(case)
    kw["attn_sink"] = None
    _, lse0 = sparse_mla_decode_ref(**kw)
    kw["attn_sink"] = (lse0[0, :, 0] + torch.randn(16, dtype=torch.float64) * 0.5).float()
    out, lse = _call(kw)
    ref_out, ref_lse = _assert_matches(kw, out, lse)
    no_sink, _ = sparse_mla_decode_ref(**dict(kw, attn_sink=None))
    assert rel_err(ref_out, no_sink) > 0.2  # the sink really matters in this case


def test_dispatcher_keeps_two_ctas_per_sm():
    """H200-class shared memory gets the 80 KB config; sm_120's 100 KB/SM gets the 48 KB one."""
    big = decode.choose_config(64, 64, smem_per_sm=233472)
    small = decode.choose_config(64, 64, smem_per_sm=102400)
    assert big.block_t == 32 and small.block_t == 16
    for cfg, smem in ((big, 233472), (small, 102400)):
        assert 2 * (cfg.shared_bytes + decode.SMEM_PER_CTA_RESERVED) <= smem
        assert cfg in decode.SPLIT_CONFIGS


def test_planner_uses_the_wide_block_only_for_large_batches_with_an_extra_cache():
    """64-head blocks at B >= 16 on c4/c128 layers (H200-measured win); B <= 4 and SWA-only keep 16."""
    for smem in (233472, 102400):  # H200 and sm_120 shared memory per SM
        for B in (16, 32, 64):
            for w2 in (512, 1024, 2048):
                p = decode.make_plan(B, 64, 128, w2, num_sms=132, smem_per_sm=smem)
                assert p.config == decode.WIDE and p.chunk >= decode.WIDE_MIN_TILES * p.config.block_t
            assert decode.make_plan(B, 64, 128, 0, num_sms=132, smem_per_sm=smem).config.block_h == 16
            assert decode.make_plan(B, 16, 128, 512, num_sms=132, smem_per_sm=smem).config.block_h == 16
        for B in (1, 4, 15):
            assert decode.make_plan(B, 64, 128, 512, num_sms=132, smem_per_sm=smem).config.block_h == 16
    # The exact plans measured on the H200 (kernels/BENCH.md): c4 B=64 and B=16, c128@256K B=16.
    assert decode.make_plan(64, 64, 128, 512, 132) == decode.Plan(decode.WIDE, 160, 1, 4)
    assert decode.make_plan(16, 64, 128, 512, 132) == decode.Plan(decode.WIDE, 64, 2, 8)
    assert decode.make_plan(16, 64, 128, 2048, 132) == decode.Plan(decode.WIDE, 96, 2, 22)
    assert decode.WIDE in decode.SPLIT_CONFIGS  # so check_sm120 gates it


def test_wide_block_chosen_by_the_planner_matches_reference():
    """B=16, c4-like: the planner's own wide plan (several splits, holes, short/empty rows)."""
    case = Case(batch=16, heads=64, width=64, page_size=64, extra_width=96, extra_page_size=64,
                hole_frac=0.1)
    kw = make_inputs(case)
    plan = decode.make_plan(16, 64, 64, 96, num_sms=4)
    assert plan.config == decode.WIDE and plan.num_splits >= 2
    out, lse = _call(kw, plan)
    _assert_matches(kw, out, lse)


def test_wide_block_two_blocks_per_row():
    """128 heads = two wide blocks per row (the q loads' mask must hold for the second one too);
    B=3 with an empty and a short row, explicit plan (the planner only goes wide from B=16)."""
    case = Case(batch=3, heads=128, width=64, page_size=64, extra_width=96, extra_page_size=64,
                hole_frac=0.1)
    kw = make_inputs(case)
    out, lse = _call(kw, decode.Plan(decode.WIDE, 64, 1, 2))
    _assert_matches(kw, out, lse)


# ------------------------------------------------------------------ head slicing (attention TP > 1)

GARBAGE = (float("nan"), float("inf"), float("-inf"), 3.0e38)


def _poison_q_outside(q, h0, h1):
    for h in range(q.shape[2]):
        if not h0 <= h < h1:
            q[:, :, h] = GARBAGE[h % len(GARBAGE)]


def _ref_on(kw, h0, h1):
    sub = dict(kw, q=kw["q"][:, :, h0:h1])
    if kw.get("attn_sink") is not None:
        sub["attn_sink"] = kw["attn_sink"][h0:h1]
    return sub


@pytest.mark.parametrize("h0,h1", [(48, 64), (8, 16)], ids=["tp4_rank3", "tp8_rank1"])
def test_head_range_reads_and_writes_only_its_heads(h0, h1):
    """64-head q with NaN/Inf/3e38 outside [h0, h1) (SGLang's uninitialised pad) and a garbage sink
    there: the slice matches the fp64 reference on the clean heads; nothing else is written."""
    case = Case(batch=3, heads=64, width=64, page_size=64, extra_width=64, extra_page_size=64, hole_frac=0.1)
    kw = make_inputs(case)
    ref_out, ref_lse = sparse_mla_decode_ref(**_ref_on(kw, h0, h1))
    _poison_q_outside(kw["q"], h0, h1)
    kw["attn_sink"][:h0] = float("nan")
    kw["attn_sink"][h1:] = float("inf")
    plan = decode.make_plan(3, h1 - h0, 64, 64, num_sms=4)
    assert plan.num_splits > 1
    out = torch.full((3, 1, 64, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((3, 1, 64), float("nan"), dtype=torch.float32)
    o, lse_t = decode.run(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"],
                          kw["softmax_scale"], kw["extra_k_cache"], kw["extra_indices"], kw["extra_topk_length"],
                          plan=plan, out=out, lse=lse, head_range=(h0, h1))
    mine, ml = o[:, :, h0:h1], lse_t[:, h0:h1]
    assert not torch.isnan(mine.float()).any() and not torch.isnan(ml).any()
    assert rel_err(mine, ref_out) <= 1e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(ml), fin)
    assert (ml.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-3
    rest = torch.ones(64, dtype=torch.bool)
    rest[h0:h1] = False
    assert torch.isnan(o[:, :, rest].float()).all() and torch.isnan(lse_t[:, rest]).all()  # never written


def test_public_entry_takes_heads_keyword():
    case = Case(batch=2, heads=32, width=64, page_size=64, sink=True)
    kw = make_inputs(case)
    ref_out, _ = sparse_mla_decode_ref(**_ref_on(kw, 16, 32))
    _poison_q_outside(kw["q"], 16, 32)
    out, lse = decode.sparse_mla_decode(**kw, head_range=(16, 32))
    assert out.shape == (2, 1, 32, 512) and lse.shape == (2, 32, 1)
    assert rel_err(out[:, :, 16:], ref_out) <= 1e-2
    for bad in ((-1, 16), (16, 33), (20, 10)):
        with pytest.raises(ValueError, match="head_range="):
            decode.sparse_mla_decode(**kw, head_range=bad)


def test_wide_block_with_a_head_range():
    """The 64-head block on heads 64..127 of a 128-head q (explicit plan, B=2): garbage elsewhere stays out."""
    case = Case(batch=2, heads=128, width=64, page_size=64, extra_width=64, extra_page_size=64)
    kw = make_inputs(case)
    ref_out, _ = sparse_mla_decode_ref(**_ref_on(kw, 64, 128))
    _poison_q_outside(kw["q"], 64, 128)
    plan = decode.Plan(decode.WIDE, 64, 1, 1)
    o, _ = decode.run(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"],
                      kw["softmax_scale"], kw["extra_k_cache"], kw["extra_indices"], kw["extra_topk_length"],
                      plan=plan, head_range=(64, 128))
    assert not torch.isnan(o[:, :, 64:].float()).any()
    assert rel_err(o[:, :, 64:], ref_out) <= 1e-2


# ------------------------------------------------------------------ one launch: fused merge / single split


def test_one_launch_merge_only_for_resident_grids_of_c4_c128_layers():
    """The cooperative merge (split programs wait for each other) is planned only on layers with an
    extra cache (measured faster there, slower on SWA-only) and grids of at most one program per
    SM; the wide block never takes it; it can be forced off (or on, still residency-checked)."""
    p = decode.make_plan(1, 16, 128, 512, num_sms=132)  # c4 B=1, TP4: 20 programs
    assert p.fused and p.num_splits == 20
    assert decode.make_plan(1, 16, 128, 2048, num_sms=132).fused  # c128@256K B=1: 68 programs
    assert not decode.make_plan(2, 16, 128, 2048, num_sms=132).fused  # 136 > 132
    assert not decode.make_plan(64, 16, 128, 512, num_sms=132).fused
    assert not decode.make_plan(1, 16, 128, 0, num_sms=132).fused  # SWA-only
    assert not decode.make_plan(1, 16, 128, 512, num_sms=132, fused=False).fused
    for B in (1, 4, 16, 64):
        for H in (8, 16, 64):
            for w2 in (0, 512, 2048):
                p = decode.make_plan(B, H, 128, w2, num_sms=132)
                programs = p.num_splits * -(-H // p.config.block_h) * B
                assert p.fused == (w2 > 0 and p.config.ksplit == 1 and p.num_splits > 1 and programs <= 132)
    assert decode.coop_fits(132, 132) and not decode.coop_fits(133, 132)
    assert decode.epilogue_for(decode.T32, 20, True) == 1
    assert decode.epilogue_for(decode.T32, 20, False) == 0
    assert decode.epilogue_for(decode.T32, 1, False) == 2
    assert decode.epilogue_for(decode.WIDE, 4, True) == 0 and decode.epilogue_for(decode.WIDE, 1, False) == 0


def test_planner_lengthens_splits_with_the_batch_on_c4_c128_layers():
    """H200-measured rule (TP4 call): 1 tile per split below 16 row blocks, 2 up to 63, then 4;
    SWA-only rows (4 tiles) stay at 1, and small-batch SWA-only layers take 16-token tiles."""
    assert decode.make_plan(1, 16, 128, 512, 132).chunk == 32
    assert decode.make_plan(16, 16, 128, 1024, 132) == decode.Plan(decode.T32, 64, 2, 16)  # 288 programs
    assert decode.make_plan(64, 16, 128, 1024, 132) == decode.Plan(decode.T32, 128, 1, 8)
    assert decode.make_plan(64, 16, 128, 2048, 132) == decode.Plan(decode.T32, 160, 1, 13)
    assert decode.make_plan(64, 16, 128, 0, 132) == decode.Plan(decode.T32, 32, 4, 0)
    assert decode.make_plan(1, 16, 128, 0, 132) == decode.Plan(decode.T16, 16, 8, 0)
    assert decode.make_plan(64, 16, 128, 512, 132, smem_per_sm=102400).config == decode.T16
    assert [decode.min_tiles_for(n, 512) for n in (1, 15, 16, 63, 64)] == [1, 1, 2, 2, 4]
    assert decode.min_tiles_for(64, 0) == 1


@pytest.mark.parametrize("q_mul,scales", [(300.0, (110, 124)), (1.0, (103, 134))], ids=["big_q", "scales_2e-24_to_2e7"])
def test_fp16_operands_match_the_reference_across_their_range(q_mul, scales):
    """The shipped fp16 configs: |q| up to ~1e3, and ue8m0 scales over the whole documented range
    2^-24..2^7 (lse compared relatively: these scores reach 1e4)."""
    case = Case(batch=2, heads=16, width=64, page_size=64, extra_width=64, extra_page_size=64, hole_frac=0.0)
    kw = make_inputs(case)
    kw["q"] = (kw["q"].float() * q_mul).to(torch.bfloat16)
    for cache in (kw["k_cache"], kw["extra_k_cache"]):
        P, ps = cache.shape[0], cache.shape[1]
        flat = cache.as_strided((P * cache.stride(0),), (1,)).view(torch.uint8)
        for page in range(P):
            base = page * cache.stride(0) + ps * 576
            sc = flat[base: base + ps * 8].view(ps, 8)
            sc[:, :7] = torch.randint(scales[0], scales[1] + 1, (ps, 7), dtype=torch.uint8)
    ref_out, ref_lse = sparse_mla_decode_ref(**kw)
    for cfg in (decode.T32, decode.T16):
        assert cfg.f16
        out, lse = _call(kw, decode.make_plan(2, 16, 64, 64, num_sms=4, config=cfg))
        assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
        assert rel_err(out, ref_out) <= 1e-2
        assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=1e-5)


def test_single_split_finishes_in_the_split_kernel():
    """One split per row (SWA-only, chunk >= width): no workspace, sink and empty rows still exact."""
    kw = make_inputs(Case(batch=3, heads=16, width=64, page_size=64))
    plan = decode.make_plan(3, 16, 64, 0, num_sms=4, min_tiles=8)
    assert plan.num_splits == 1 and decode.epilogue_for(plan.config, 1, plan.fused) == 2
    out, lse = _call(kw, plan)
    _assert_matches(kw, out, lse)


# ------------------------------------------------------------------ the TP-aware adapter


def test_heads_for_tp_sizes_and_dp_attention():
    from v4flash_kernels.hook.tp_heads import AttnTp, heads_for

    assert heads_for(64, None) is None
    assert heads_for(64, AttnTp(0, 1)) is None  # TP1, or DP attention with attn-TP 1: all heads
    assert heads_for(64, AttnTp(1, 2)) == (32, 64)
    assert [heads_for(64, AttnTp(r, 4)) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert heads_for(64, AttnTp(7, 8)) == (56, 64)
    assert heads_for(128, AttnTp(3, 4)) == (96, 128)  # V4-Pro width
    assert heads_for(48, AttnTp(0, 32)) is None  # does not divide: all heads (always correct)
    assert heads_for(64, AttnTp(4, 4)) is None  # nonsense rank: all heads


def test_adapter_reads_the_rank_once_and_passes_heads():
    from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware

    seen, reads = [], []

    def ours(*args, head_range=None):
        seen.append((len(args), head_range))
        return "out", "lse"

    answers = [None, AttnTp(2, 4), AttnTp(0, 1)]

    def read():
        reads.append(1)
        return answers[len(reads) - 1]

    fn = make_tp_aware(ours, read=read)
    q = torch.empty(1, 1, 64, 512)
    assert fn(q, None, None, None, None, 512, 0.1) == ("out", "lse")  # rank unknown yet: all heads
    fn(q, None, None, None, None, 512, 0.1, None, None, None)
    fn(q=q, k_cache=None, indices=None, topk_length=None, attn_sink=None, head_dim_v=512, softmax_scale=0.1)
    assert seen == [(10, None), (10, (32, 48)), (10, (32, 48))]
    assert len(reads) == 2  # retried once after "unknown", then cached for the process


def test_adapter_end_to_end_matches_reference_on_the_rank_slice():
    from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware

    case = Case(batch=2, heads=64, width=64, page_size=64, extra_width=64, extra_page_size=64)
    kw = make_inputs(case)
    ref_out, ref_lse = sparse_mla_decode_ref(**_ref_on(kw, 16, 32))
    _poison_q_outside(kw["q"], 16, 32)
    fn = make_tp_aware(decode.sparse_mla_decode, read=lambda: AttnTp(1, 4))
    out, lse = fn(**kw)
    assert out.shape == (2, 1, 64, 512) and lse.shape == (2, 64, 1)
    assert rel_err(out[:, :, 16:32], ref_out) <= 1e-2
    fin = torch.isfinite(ref_lse)
    assert (lse[:, 16:32].double()[fin] - ref_lse[fin]).abs().max().item() < 1e-3


def test_read_attn_tp_without_sglang_process_groups_means_all_heads():
    from v4flash_kernels.hook.tp_heads import read_attn_tp

    assert read_attn_tp() is None  # sglang absent or its groups not initialised here


def test_bench_composes_the_decode_step_from_tp4_b1_rows():
    """Attention per decode step at B=1, 128K: 2 SWA + 21 c4 + 20 c128 calls; None when a row is missing."""
    import v4flash_bench.attention as bench

    def row(kind, mode, batch, us):
        return {"kind": kind, "mode": mode, "batch": batch, "heads": 64, "tokens": 1, "floor_h200_us": 0.1,
                "floor_rtx6000_us": 0.2, "plan": "p", "variants": {"ours": {"us": us, "ok": True, "rel_err": 1e-3}}}

    rows = [row("swa", "tp4", 1, 10.0), row("c4", "tp4", 1, 11.0), row("c128@128K", "tp4", 1, 12.0),
            row("c4", "full64", 1, 99.0), row("c4", "tp4", 4, 99.0)]
    assert bench.step_time_us(rows) == 2 * 10.0 + 21 * 11.0 + 20 * 12.0
    assert bench.step_time_us(rows[1:]) is None
    assert "| c4 | tp4 | 1 |" in bench.format_markdown(rows) and "– | –" in bench.format_markdown(rows)
    assert "tp4" in bench.format_table(rows)
    from v4flash_kernels.kit import table

    v = dict(rows[0]["variants"], fast={"us": 8.0, "ok": True, "rel_err": 2e-3},
             broken={"us": 1.0, "ok": False, "rel_err": 1.0})
    ours, best_name, best, up, err, bad = table.variant_summary(v)
    assert (ours, best_name, best, err, bad) == (10.0, "fast", 8.0, 1.0, "  FAIL:broken") and math.isnan(up)
    assert bench.Shape("c4", 1, 64, "tp4", 3).head_slice == slice(48, 64)
    q = torch.zeros(1, 1, 64, 512)
    bench.poison_other_heads(q, slice(16, 32))
    assert torch.isfinite(q[:, :, 16:32]).all() and not torch.isfinite(q[:, :, :16]).all()
    assert torch.isnan(q[:, :, 32]).all() and (q[:, :, 35] == 3.0e38).all()


def _load_script(name):
    """A module of kernels/scripts/ (not a package) by path."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "kernels" / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_v4flash_script_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their module while it runs
    spec.loader.exec_module(mod)
    return mod


def test_dropped_variants_outside_the_shipped_kernel_still_match_reference():
    """The register-prefetch and latent-across-warps paths moved to kernels/scripts/attention_variants.py:
    they still build on the shipped kernel's helpers and give the reference's result."""
    av = _load_script("attention_variants")
    case = Case(batch=2, heads=8, width=64, page_size=64, extra_width=96, extra_page_size=2, extra_dense=True)
    res = av.run_shape(make_inputs(case), av.VARIANTS)
    assert set(res) == {v.name for v in av.VARIANTS} and {v.mode for v in av.VARIANTS} == set(av.MODES)
    assert all(r["ok"] for r in res.values()), res
