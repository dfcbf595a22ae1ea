"""Every patched op at speculative-decoding verify shapes, under Triton's CPU interpreter.

A verify step (EAGLE, top-k 1, k draft steps) runs `R = bs x (k + 1)` rows through every layer, the
k + 1 rows of one request with consecutive lengths L + 1 .. L + k + 1 over that request's cache and
page table (tests/kernels/verify_rows.py says exactly what each op receives). The decode worker
captures bs in 1..8, 10..32 step 2, 40..64 step 4 (SGLang's speculative list up to the profile's
--cuda-graph-max-bs 64), so with k = 1..3, R is one of 2..256 (52 values).

Which plans change with R (`test_plan_branches_at_verify_rows` pins these tables, TP4 shapes,
128K context; "H200" = 132 SMs, "sm_120" = the RTX PRO 6000's 188 SMs and 100 KB per SM):
- sparse-MLA decode (one TP4 rank's 16 heads): SWA layers 16-token tiles below R = 16, 32-token
  from 16 (H200; sm_120 always 16); c4/c128 layers: the one-launch cooperative merge while the grid
  fits the SMs (H200: R <= 6 on c4, <= 3 on c128), then split + combine; tokens per split 1 tile
  below R = 16, 2 tiles from 16, 4 from 64 (c128 at 128K: up to 5 tiles on the H200, 7 on sm_120). The 64-head
  block never runs at TP4 (it needs 64 heads per rank).
- indexer logits: programs per row ~ 8 per SM spread over the rows (capped at a row's tiles at R = 2),
  16 per SM from R = 64.
- top-512: the first-2K-scores speculative load up to R = 64, the plain one above; one program per row
  up to R = SMs (132 on the H200, 188 on sm_120), persistent programs above.
- FP8 linears (wqkv_a, wq_b, wo_b, shared gate_up/down): the GEMV (shared gate_up only, R <= 4), the
  swap-AB 16-row tile with the quant fused (R <= 16), then the separate quant and 64-row tiles, K split
  by the tile count (it changes with each new row tile: R = 65, 129, 193; per GPU, by its SM count),
  unsplit for wq_b and shared down.
- MXFP4 MoE (256 experts, top-6, TP4 intermediate 512): v1 (drop-in) inline grouping at R = 2, sorted
  3-stage GEMM1 up to R = 15, sorted 1-stage from 16, 32x64 tiles from 171; v2 (repacked layers) inline at R = 2, sorted
  8-token MMA tiles up to R = 104, 16-token tiles from 112. The v2 split-K plan (R = 1) never runs.
- mHC pre/post: one launch (mix + ticketed finish) up to R = 64, with 4 tokens per ticketed block up
  to R = 16 (the hidden dimension split 128, 64, 32 ways as the blocks grow to 4), 8 up to 32, 16 up to
  64; from R = 65 the two-launch prefill tiling (64-token blocks, 128 splits): the same on both GPUs.
- the tables cover every R up to 256, the largest verify graph (64 requests, 3 draft steps).

Each op below runs every one of those plans on verify-shaped rows against its fp64 reference (the
plan of a row class given explicitly where the class's R exceeds the small batch run here; the
interpreter runs the cooperative merge as split + combine), and the wheel's own function on the same
verify-shaped inputs. Small dims where the kernel allows (the MoE's experts and sizes, the FP8
weights' N, mHC's hidden); the attention and indexer widths are the real ones except the context
(16K here, so c128 rows are 128 wide).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import verify_rows as V

from v4flash_kernels.attention import op as decode
from v4flash_kernels.attention.reference import sparse_mla_decode_ref
from v4flash_kernels.kit.compare import rel_err

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)
CPU_CONTEXT = 16384


def _layout(bs: int, k: int, seed: int, context: int = CPU_CONTEXT) -> V.Layout:
    g = torch.Generator().manual_seed(seed)
    return V.make_layout(V.draw_batch(bs, k, context, g), context, g)


@pytest.fixture(scope="module")
def shapes():
    return V.verify_shapes(V.spec_capture_bs())


# ----------------------------------------------------------------------------- which rows, which plans


def test_capture_sizes_come_from_the_wheel_and_the_launcher(shapes):
    """The spec capture list is SGLang's (read from the wheel), the worker's facts the launcher's."""
    from v4flash_pd.profiles import DEFAULT_PROFILE, get_profile

    assert V.spec_capture_bs() == tuple(range(1, 9)) + tuple(range(10, 33, 2)) + tuple(range(40, 65, 4))
    assert V.spec_capture_bs(512)[-3:] == (240, 248, 256) and 9 not in V.spec_capture_bs(512)  # <= max running
    prof = get_profile(DEFAULT_PROFILE)
    (decode_worker,) = prof["decode"]
    assert decode_worker["cuda_graph_max_bs"] == V.DECODE_GRAPH_MAX_BS and decode_worker["tp"] == V.TP
    assert prof["engine"]["context_length"] == V.CONTEXT
    rows = sorted({r for _, _, r in shapes})
    assert len(rows) == 52 and rows[:6] == [2, 3, 4, 6, 8, 9] and rows[-3:] == [224, 240, 256]
    assert max(rows) == MAX_ROWS
    assert all(r == b * (k + 1) for b, k, r in shapes) and {k for _, k, _ in shapes} == {1, 2, 3}


H200_ATTN = {
    "swa": [(2, 15, "h16_t16_w4_f16/chunk16/combine"), (16, 131, "h16_t32_w4_f16/chunk32/combine"),
            (132, 256, "h16_t32_w4_f16/chunk128/one-split")],
    "c4": [(2, 6, "h16_t32_w4_f16/chunk32/one-launch"), (7, 15, "h16_t32_w4_f16/chunk32/combine"),
           (16, 63, "h16_t32_w4_f16/chunk64/combine"),
           (64, 211, "h16_t32_w4_f16/chunk128/combine"),
           (212, 256, "h16_t32_w4_f16/chunk160/combine")],
    "c128": [(2, 3, "h16_t32_w4_f16/chunk32/one-launch"), (4, 15, "h16_t32_w4_f16/chunk32/combine"),
             (16, 58, "h16_t32_w4_f16/chunk64/combine"),
             (59, 63, "h16_t32_w4_f16/chunk96/combine"),
             (64, 117, "h16_t32_w4_f16/chunk128/combine"),
             (118, 146, "h16_t32_w4_f16/chunk160/combine"),
             (147, 176, "h16_t32_w4_f16/chunk192/combine"),
             (177, 205, "h16_t32_w4_f16/chunk224/combine"),
             (206, 234, "h16_t32_w4_f16/chunk256/combine"),
             (235, 256, "h16_t32_w4_f16/chunk288/combine")],
}
SM120_ATTN = {
    "swa": [(2, 187, "h16_t16_w4_f16/chunk16/combine"), (188, 256, "h16_t16_w4_f16/chunk64/combine")],
    "c4": [(2, 4, "h16_t16_w4_f16/chunk16/one-launch"), (5, 15, "h16_t16_w4_f16/chunk16/combine"),
           (16, 63, "h16_t16_w4_f16/chunk32/combine"), (64, 150, "h16_t16_w4_f16/chunk64/combine"),
           (151, 188, "h16_t16_w4_f16/chunk80/combine"),
           (189, 225, "h16_t16_w4_f16/chunk96/combine"),
           (226, 256, "h16_t16_w4_f16/chunk112/combine")],
    "c128": [(2, 2, "h16_t16_w4_f16/chunk16/one-launch"), (3, 15, "h16_t16_w4_f16/chunk16/combine"),
             (16, 41, "h16_t16_w4_f16/chunk32/combine"),
             (42, 62, "h16_t16_w4_f16/chunk48/combine"),
             (63, 83, "h16_t16_w4_f16/chunk64/combine"),
             (84, 104, "h16_t16_w4_f16/chunk80/combine"),
             (105, 125, "h16_t16_w4_f16/chunk96/combine"),
             (126, 146, "h16_t16_w4_f16/chunk112/combine"),
             (147, 167, "h16_t16_w4_f16/chunk128/combine"),
             (168, 188, "h16_t16_w4_f16/chunk144/combine"),
             (189, 208, "h16_t16_w4_f16/chunk160/combine"),
             (209, 229, "h16_t16_w4_f16/chunk176/combine"),
             (230, 250, "h16_t16_w4_f16/chunk192/combine"),
             (251, 256, "h16_t16_w4_f16/chunk208/combine")],
}
H200_FP8 = {
    "wqkv_a": [(2, 16, "dot_m16_n128_w4_s2_swap_fq_reducec2/split16"),
               (17, 64, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split16"),
               (65, 128, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split11"),
               (129, 192, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split7"),
               (193, 256, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split5")],
    "wq_b": [(2, 16, "dot_m16_n128_w4_s2_swap_fq_ticketc2/split4"),
             (17, 256, "dot_m64_n128_w4_s3_sepq_g32_whole")],
    "wo_b": [(2, 16, "dot_m16_n128_w4_s2_swap_fq_ticketc2/split8"),
             (17, 64, "dot_m64_n64_w4_s3_sepq_ticketc2/split4"),
             (65, 128, "dot_m64_n64_w4_s3_sepq_ticketc2/split2"),
             (129, 256, "dot_m64_n64_w4_s3_sepq_whole")],
    "shared_gate_up": [(2, 4, "gemv_n8_K_w8"), (5, 16, "dot_m16_n128_w4_s2_swap_fq_reducec2/split32"),
                       (17, 64, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split32"),
                       (65, 128, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split16"),
                       (129, 192, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split11"),
                       (193, 256, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split8")],
    "shared_down": [(2, 16, "dot_m16_n128_w4_s2_swap_fq_ticketc2/split4"),
                    (17, 256, "dot_m64_n128_w4_s3_sepq_g32_whole")],
}
SM120_FP8 = {
    "wqkv_a": [(2, 16, "dot_m16_n128_w4_s2_swap_fq_reducec2/split16"),
               (17, 64, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split16"),
               (65, 128, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split11"),
               (129, 192, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split8"),
               (193, 256, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split7")],
    "wq_b": [(2, 16, "dot_m16_n128_w4_s2_swap_fq_ticketc2/split4"),
             (17, 256, "dot_m64_n128_w4_s3_sepq_g32_whole")],
    "wo_b": [(2, 16, "dot_m16_n128_w4_s2_swap_fq_ticketc2/split8"),
             (17, 64, "dot_m64_n64_w4_s3_sepq_ticketc2/split4"),
             (65, 128, "dot_m64_n64_w4_s3_sepq_ticketc2/split2"),
             (129, 256, "dot_m64_n64_w4_s3_sepq_whole")],
    "shared_gate_up": [(2, 4, "gemv_n8_K_w8"), (5, 16, "dot_m16_n128_w4_s2_swap_fq_reducec2/split32"),
                       (17, 64, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split32"),
                       (65, 128, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split16"),
                       (129, 256, "dot_m64_n128_w4_s3_sepq_g32_reducec2/split11")],
    "shared_down": [(2, 16, "dot_m16_n128_w4_s2_swap_fq_ticketc2/split4"),
                    (17, 256, "dot_m64_n128_w4_s3_sepq_g32_whole")],
}
MOE = {
    "v1": [(2, 2, "inline/g1:m16_n16_k256_w4_s3/g2:m16_n32_k128_w2_s3"),
           (3, 15, "sorted/g1:m16_n16_k256_w4_s3/g2:m16_n32_k128_w2_s3"),
           (16, 170, "sorted/g1:m16_n16_k256_w4_s1/g2:m16_n32_k128_w2_s3"),
           (171, 256, "sorted/g1:m32_n64_k128_w4_s3/g2:m64_n64_k64_w4_s3")],
    "v2": [(2, 2, "v2-inline/g1:t8_n64_k256_w4_s3/g2:t8_n64_k256_w4_s3"),
           (3, 106, "v2-sorted/g1:t8_n64_k256_w4_s3/g2:t8_n64_k256_w4_s3"),
           (107, 256, "v2-sorted/g1:t16_n64_k256_w4_s3/g2:t16_n64_k256_w4_s3")],
}
INDEXER = [(2, 2, "p1_w4_s1_c8_b16/8-per-SM/capped-at-tiles"), (3, 63, "p1_w4_s1_c8_b16/8-per-SM"),
           (64, 256, "p1_w4_s1_c8_b16/16-per-SM")]
H200_TOPK = [(2, 64, "spec=True/program-per-row"), (65, 132, "spec=False/program-per-row"),
             (133, 256, "spec=False/persistent")]
SM120_TOPK = [(2, 64, "spec=True/program-per-row"), (65, 188, "spec=False/program-per-row"),
              (189, 256, "spec=False/persistent")]
MHC = [(2, 4, "t16_s128_h32_w8_k4"), (5, 8, "t16_s64_h32_w8_k4"), (9, 16, "t16_s32_h32_w8_k4"),
       (17, 32, "t16_s32_h32_w8_k8"), (33, 64, "t16_s32_h32_w8_k16"),
       (65, 256, "t64_s128_h32_w8_2launch")]


MAX_ROWS = 256  # 64 requests x 4 verify rows (3 draft steps), the largest captured verify graph


def _table(label, *args):
    """Runs of `label(R, *args)` over every R in 2..MAX_ROWS (not only the captured ones): exact boundaries."""
    return V.row_ranges(range(2, MAX_ROWS + 1), lambda r: label(r, *args))


def test_plan_branches_at_verify_rows(shapes):
    """The tables of the module docstring, as the planners give them over R = 2..MAX_ROWS; every boundary
    the captured verify sizes reach is listed (a retuned planner must update the docstring)."""
    for gpu, attn, fp8, topk in ((V.H200, H200_ATTN, H200_FP8, H200_TOPK), (V.RTX6000, SM120_ATTN, SM120_FP8, SM120_TOPK)):
        for kind, want in attn.items():
            assert _table(V.attention_label, kind, gpu) == want, (gpu.name, kind)
        assert _table(V.indexer_label, gpu) == INDEXER, gpu.name
        assert _table(V.topk_label, gpu) == topk, gpu.name
        for shape, want in fp8.items():
            assert _table(V.fp8_label, shape, gpu) == want, (gpu.name, shape)
        assert _table(V.mhc_label, gpu) == MHC, gpu.name
    for version, want in MOE.items():
        assert _table(V.moe_label, version) == want, version
    # Every label is reached by some captured verify size (so the GPU test, which covers the labels
    # of the captured sizes, runs every one of them).
    rows = {r for _, _, r in shapes}
    tables = [*H200_ATTN.values(), *SM120_ATTN.values(), *H200_FP8.values(), *SM120_FP8.values(), *MOE.values(),
              INDEXER, H200_TOPK, SM120_TOPK, MHC]
    for table in tables:
        for lo, hi, lab in table:
            assert any(lo <= r <= hi for r in rows), lab


# ----------------------------------------------------------------------------- the verify layout is SGLang's


def _backend_methods(*names: str) -> dict:
    """`DeepseekV4AttnBackend` methods from the wheel, as functions of a stand-in `self`."""
    from v4flash_kernels import upstream

    text, origin = upstream.source_of("sglang/srt/layers/attention/deepseek_v4_backend.py")
    ns: dict = {"torch": torch, "SWA_WINDOW": V.SWA}
    exec(compile(upstream.extract_methods(text, "DeepseekV4AttnBackend", names), origin, "exec"), ns)
    return ns


def test_builder_rows_are_what_sglangs_verify_metadata_makes():
    """The wheel's own verify metadata on the same batch: `expand_extend_with_same_length` (rows and
    lengths), `get_swa_page_indices` (the SWA window), the Triton `init_compression_metadata` (c4/c128
    lengths and the c128 page indices) equal what verify_rows builds."""
    from v4flash_kernels.upstream import load_module

    lay = _layout(4, 3, seed=1)
    b = lay.batch
    ints = {"device": "cpu", "dtype": torch.int32}
    m = _backend_methods("expand_extend_with_same_length", "get_swa_page_indices")
    seq = torch.tensor(b.committed, dtype=torch.int32) + (b.k + 1)  # + num_draft_tokens, as the backend does
    seq_casual, req_rep = m["expand_extend_with_same_length"](SimpleNamespace(cuda_int32_kwargs=ints), b.requests,
                                                              b.k + 1, seq, torch.arange(b.requests))
    assert torch.equal(seq_casual.long(), b.seq_lens()) and torch.equal(req_rep, b.request_of_row())
    # SWA: a req_to_token of distinct full locations, and a full -> SWA map that sends request r's
    # position first[r] + i to the builder's slot (and -1 to -1: SGLang's map ends in one -1).
    g = torch.Generator().manual_seed(2)
    slots, first = V.swa_slots(b, g)
    req_to_token = torch.arange(b.requests * lay.context, dtype=torch.int64).view(b.requests, lay.context)
    full_to_swa = torch.full((req_to_token.numel() + 1,), -5, dtype=torch.int64)
    full_to_swa[-1] = -1
    for r in range(b.requests):
        span = torch.arange(slots.shape[1]) + first[r]
        full_to_swa[req_to_token[r, span]] = slots[r]
    pool = SimpleNamespace(translate_loc_from_full_to_swa=lambda loc: full_to_swa[loc])
    me = SimpleNamespace(cuda_int32_kwargs=ints, req_to_token=req_to_token, token_to_kv_pool=pool)
    theirs = m["get_swa_page_indices"](me, seq_casual, req_rep)
    assert torch.equal(theirs, V.swa_indices(b, slots, first))
    # c4 / c128 lengths and the c128 indices from the wheel's metadata kernel.
    meta = load_module("sglang/srt/layers/attention/dsv4/metadata_kernel.py")
    table = lay.row_table()
    (_, _, c4_raw, c4_clamp1, _, _, c128_clamp1, c128_idx) = meta.init_compression_metadata(
        seq_casual, seq_casual - 1, torch.zeros_like(seq_casual), table, V.RAW_PAGE)
    kw = V.attention_inputs(lay, "c128", 16, torch.Generator().manual_seed(3))
    assert torch.equal(c128_idx, kw["extra_indices"].view(b.rows, -1))
    assert torch.equal(c128_clamp1, kw["extra_topk_length"])
    kw4 = V.attention_inputs(lay, "c4", 16, torch.Generator().manual_seed(3))
    assert torch.equal(c4_raw.long(), b.seq_lens() // 4)
    assert torch.equal(c4_clamp1.clamp(max=V.C4_TOPK), kw4["extra_topk_length"])  # init_flashmla_related
    # The rows really are a verify batch: each request's rows see consecutive lengths, their SWA
    # windows are the previous row's shifted by one token, the edges are crossed.
    s = b.seq_lens().view(b.requests, b.k + 1)
    assert torch.equal(s[:, 1:] - s[:, :-1], torch.ones_like(s[:, 1:]))
    idx = kw["indices"].view(b.requests, b.k + 1, V.SWA)
    assert torch.equal(idx[:, 1:, 1:], idx[:, :-1, :-1])
    assert any(len(set((row // 128).tolist())) > 1 for row in s)  # a c128 length and the SWA window change
    assert any({512, 513} <= set((row // 4).tolist()) for row in s)  # the top-512 starts selecting
    assert any(0 in (row // 4).tolist() and 1 in (row // 4).tolist() for row in s)  # the first c4 entry


# ----------------------------------------------------------------------------- sparse-MLA decode


def _poisoned_decode(kw: dict, plan=None, head_range=None):
    R, _, H, D = kw["q"].shape
    out = torch.full((R, 1, H, D), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((R, 1, H), float("nan"), dtype=torch.float32)
    return decode.run(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"], kw["softmax_scale"],
                      kw.get("extra_k_cache"), kw.get("extra_indices"), kw.get("extra_topk_length"), plan=plan,
                      out=out, lse=lse, head_range=head_range)


def _assert_attention(out, lse, ref_out, ref_lse, tol_lse=1e-3):
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any(), "NaN (or unwritten) element"
    assert rel_err(out, ref_out) <= 1e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < tol_lse
    empty = ref_out.abs().amax(dim=(1, 3)) == 0
    assert torch.all(out.float().amax(dim=(1, 3)).abs()[empty] == 0)


@pytest.mark.parametrize("kind", ["swa", "c4", "c128"])
def test_attention_tp4_entry_on_verify_rows(kind):
    """SGLang's TP4 call at a verify step: 3 requests x 3 rows, a 64-head q (this rank's 16 heads real,
    the rest NaN/Inf), through the TP adapter and the planner; the rank's slice against fp64, nothing
    else written."""
    from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware

    kw = V.attention_inputs(_layout(3, 2, seed=10), kind, 16, torch.Generator().manual_seed(11))
    ref_out, ref_lse = sparse_mla_decode_ref(**kw)
    call, keep = V.tp4_query(kw, rank=2)
    out, lse = make_tp_aware(decode.sparse_mla_decode, read=lambda: AttnTp(2, 4))(**call)
    assert out.shape == (9, 1, 64, 512) and lse.shape == (9, 64, 1)
    _assert_attention(out[:, :, keep], lse[:, keep], ref_out, ref_lse)


def _verify_plans(kind: str, context: int) -> list:
    """Every distinct plan the H200 and sm_120 planners give a TP4 rank over the captured verify rows,
    those differing only in the cooperative merge once (the interpreter runs it as split + combine)."""
    w_b = {"swa": 0, "c4": V.C4_TOPK, "c128": V.c128_width(context)}[kind]
    rows = sorted({r for _, _, r in V.verify_shapes(V.spec_capture_bs())})
    plans: dict = {}
    for gpu in (V.H200, V.RTX6000):
        for r in rows:
            p = decode.make_plan(r, V.HEADS_PER_RANK, V.SWA, w_b, gpu.sms, smem_per_sm=gpu.smem)
            plans.setdefault((p.config, p.chunk, p.splits_main, p.splits_extra), p)
    return list(plans.values())


@pytest.mark.parametrize("kind", ["swa", "c4", "c128"])
def test_attention_every_verify_plan(kind):
    """Each plan the planners choose at some verify R (this context's widths), on 2 requests x 2 rows."""
    plans = _verify_plans(kind, CPU_CONTEXT)
    assert len(plans) == {"swa": 4, "c4": 10, "c128": 6}[kind]
    kw = V.attention_inputs(_layout(2, 1, seed=20), kind, 16, torch.Generator().manual_seed(21))
    ref_out, ref_lse = sparse_mla_decode_ref(**kw)
    for plan in plans:
        out, lse = _poisoned_decode(kw, plan)
        _assert_attention(out, lse, ref_out, ref_lse)


@pytest.fixture
def upstream_attention(monkeypatch):
    """The wheel's `flash_mla_sparse_decode_triton`; its autotuner cannot time configs here, so every
    config reports the same time and its first one runs (the math is the kernel's)."""
    from triton.runtime import autotuner

    from v4flash_kernels.upstream import load_upstream

    monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, config, **k: [0.0, 0.0, 0.0])
    return load_upstream().flash_mla_sparse_decode_triton


@pytest.mark.parametrize("kind", ["swa", "c4", "c128"])
def test_attention_matches_upstream_on_verify_rows(kind, upstream_attention):
    """2 requests x 4 rows (k = 3), 4 heads (upstream's grid is one program per row and head: the
    interpreter's cost); ours, upstream and fp64 on the same inputs."""
    kw = V.attention_inputs(_layout(2, 3, seed=30), kind, 4, torch.Generator().manual_seed(31))
    ref_out, ref_lse = sparse_mla_decode_ref(**kw)
    out, lse = decode.sparse_mla_decode(**kw)
    _assert_attention(out, lse, ref_out, ref_lse)
    up_out, up_lse = upstream_attention(**kw)
    _assert_attention(up_out, up_lse.float(), ref_out, ref_lse, tol_lse=1e-2)
    assert rel_err(out, up_out.double()) <= 1e-2


# ----------------------------------------------------------------------------- indexer logits


def test_indexer_on_verify_rows_every_grid_and_upstream():
    """4 requests x 4 rows over shared page tables: the programs per row each verify class gives (at
    this context's 64 pages per row), the planner's own; fp64 and the wheel's torch logits."""
    from v4flash_kernels.indexer import op as ix
    from v4flash_kernels.indexer.reference import logits_error, reference_for
    from v4flash_kernels.upstream import load_indexer

    lay = _layout(4, 3, seed=40)
    kw = V.indexer_inputs(lay, torch.Generator().manual_seed(41))
    ref = reference_for(kw)
    up = load_indexer().fp8_paged_mqa_logits_torch_sm120(*kw.values())
    e = logits_error(up, ref)
    assert not e["nan"] and e["inf_ok"] and e["rel_err"] <= 1e-5, e
    pages = kw["max_seq_len"] // ix.PAGE
    rows = sorted({r for _, _, r in V.verify_shapes(V.spec_capture_bs())})
    classes = [(2, "capped-at-tiles"), (60, "8-per-SM"), (128, "16-per-SM")]  # INDEXER's classes
    assert all(tag in V.indexer_label(r, V.H200) and r in rows for r, tag in classes)
    nprogs = {ix.programs_per_row(r, pages, V.H200.sms, ix.DEFAULT) for r, _ in classes} | {None}  # None: the
    assert max(n for n in nprogs if n) == pages and len(nprogs) == 4  # planner's own (4 SMs here)
    for nprog in sorted(nprogs, key=lambda n: n or 0):
        out = torch.full((lay.batch.rows, kw["max_seq_len"]), float("nan"))
        ix.run(kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["seq_lens"], kw["page_table"], kw["max_seq_len"],
               nprog=nprog, out=out)
        e = logits_error(out, ref)
        assert not e["nan"] and e["inf_ok"] and e["rel_err"] <= 1e-5, (nprog, e)
        fin = torch.isfinite(up)
        assert (out[fin] - up[fin]).abs().max() <= 1e-5 * up[fin].abs().max()
    assert torch.equal(ix.fp8_paged_mqa_logits(*kw.values()), out)


# ----------------------------------------------------------------------------- top-512


@pytest.mark.parametrize("spec", [True, False], ids=["spec_up_to_64_rows", "plain_above_64_rows"])
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "in_graph_no_raw"])
def test_topk_on_verify_rows(spec, raw, monkeypatch):
    """4 requests x 4 rows scoring the same keys (correlated rows, -inf past each c4 length, a request
    whose rows go 512 -> 513 positions): exact against the reference, the same sets as the wheel's
    torch top-512. The > 64-row binary (no speculative load) is run on these rows by lowering the bound."""
    from v4flash_kernels.topk import op as tk
    from v4flash_kernels.topk.reference import topk_transform_ref
    from v4flash_kernels.upstream import load_indexer

    if not spec:
        monkeypatch.setattr(tk, "SPEC_MAX_ROWS", 0)
    lay = _layout(4, 3, seed=50)
    scores = V.verify_scores(lay, torch.Generator().manual_seed(51))
    kw = V.topk_inputs(lay, scores, raw=raw)
    assert tk.speculate(lay.batch.rows, 512) is spec
    n4 = kw["seq_lens"].tolist()
    assert {512, 513} <= set(n4) and min(n4) < 4
    tk.topk_transform_512(*kw.values())
    want_pages, want_raw = topk_transform_ref(scores, kw["seq_lens"], kw["page_tables"], 512, V.C4_PAGE)
    assert torch.equal(kw["out_page_indices"], want_pages)
    if raw:
        assert torch.equal(kw["out_raw_indices"], want_raw)
    up_pages = torch.empty_like(want_pages)
    up_raw = torch.empty_like(want_raw)
    load_indexer().topk_transform_512_pytorch_vectorized(scores, kw["seq_lens"], kw["page_tables"], up_pages,
                                                         V.C4_PAGE, up_raw)
    assert torch.equal(torch.sort(up_pages, dim=1).values, torch.sort(want_pages, dim=1).values)
    assert torch.equal(torch.sort(up_raw, dim=1).values, torch.sort(want_raw, dim=1).values)


# ----------------------------------------------------------------------------- FP8 linears


def _class_rows(table):
    """The fewest captured verify rows of each (lo, hi, label) row class."""
    rows = sorted({r for _, _, r in V.verify_shapes(V.spec_capture_bs())})
    return [(min(r for r in rows if lo <= r <= hi), lab) for lo, hi, lab in table]


def test_fp8_every_verify_plan_matches_reference():
    """Every TP4 shape's plan of each verify row class, at that class's fewest captured rows, on the real
    K (groups, splits) and a 256-row slice of N; within the bound of one bf16 rounding of fp64."""
    from v4flash_kernels.fp8_gemm import op as f8
    from v4flash_kernels.fp8_gemm.reference import linear_ref, make_activation, make_weight
    from v4flash_kernels.kit.compare import excess_error

    g = torch.Generator().manual_seed(60)
    seen = set()
    for shape, table in H200_FP8.items():
        n, k = V.FP8_SHAPES[shape]
        w, ws = make_weight(256, k, g)
        for rows, _ in _class_rows(table):
            p = f8.plan(rows, n, k, V.H200.sms)
            if (p.name, k, rows) in seen:
                continue
            seen.add((p.name, k, rows))
            x = make_activation(rows, k, g)
            out = f8.linear_2d(x, w, ws, config=p.config, split=p.split)
            ref, mag = linear_ref(x, w, ws)
            assert excess_error(out, ref, mag, 2.0 ** -7, 2.0 ** -16) <= 1.0, (shape, rows, p.name)
    assert len(seen) == 19


@pytest.mark.parametrize("rows", [4, 12, 66], ids=["R4", "R12", "R66"])
def test_fp8_linear_drop_in_matches_upstream_on_verify_rows(rows):
    """The public drop-in on a [rows, K] activation (SGLang's call) against fp64 and the wheel's GEMM
    on the definition's quantized activation (the same function, to rounding)."""
    from v4flash_kernels.fp8_gemm import op as f8
    from v4flash_kernels.fp8_gemm.reference import linear_ref, make_activation, make_weight
    from v4flash_kernels.fp8_gemm.upstream import upstream_fp8_kernel
    from v4flash_kernels.kit.compare import excess_error
    from v4flash_kernels.kit.fp8 import quantize_activation_ref

    g = torch.Generator().manual_seed(70 + rows)
    x = make_activation(rows, 1024, g)
    w, ws = make_weight(256, 1024, g)
    out = f8.w8a8_block_fp8_linear(x, w, [128, 128], ws)
    ref, mag = linear_ref(x, w, ws)
    assert out.shape == (rows, 256) and out.dtype == torch.bfloat16
    assert excess_error(out, ref, mag, 2.0 ** -7, 2.0 ** -16) <= 1.0
    qr, sr = quantize_activation_ref(x)
    up = upstream_fp8_kernel().w8a8_block_fp8_matmul_triton(qr, w, sr, ws, [128, 128], output_dtype=torch.bfloat16)
    assert (out.float() - up.float()).abs().max() <= 2 * 2.0 ** -7 * up.float().abs().max()


# ----------------------------------------------------------------------------- MXFP4 MoE


MOE_SMALL = {"experts": 16, "hidden": 256, "inter": 64}
MOE_MAX_ROWS = 24  # a class whose fewest rows exceed this runs its plan on this many rows


def _moe_inputs(lay: V.Layout, seed: int) -> dict:
    """Small-dim experts; each request's rows route around one shared set of experts (consecutive
    tokens), one slot in ten dropped (-1)."""
    from v4flash_kernels.moe.reference import make_weights

    g = torch.Generator().manual_seed(seed)
    E, K, inter = MOE_SMALL["experts"], MOE_SMALL["hidden"], MOE_SMALL["inter"]
    w13, w2, s13, s2 = make_weights(E, K, inter, False, g)[0]
    b = lay.batch
    base = torch.rand((b.requests, E), generator=g)[b.request_of_row()]
    ids = (base + 0.3 * torch.rand((b.rows, E), generator=g)).topk(6, dim=1).indices.to(torch.int32)
    ids = torch.where(torch.rand(ids.shape, generator=g) < 0.1, -1, ids)
    return {"hidden_states": torch.randn((b.rows, K), generator=g).to(torch.bfloat16), "w13_packed": w13,
            "w2_packed": w2, "w13_scale": s13, "w2_scale": s2, "topk_ids": ids,
            "topk_weights": torch.softmax(torch.randn(ids.shape, generator=g), dim=1), "hidden_size": K,
            "intermediate_size": inter, "routed_scaling_factor": 1.5, "clamp_limit": 0.4}


def _rows_layout(rows: int, seed: int) -> V.Layout:
    """A verify batch of exactly `rows` rows (k = 3 when it divides, else 2, else 1)."""
    k = next(k for k in (3, 2, 1) if rows % (k + 1) == 0)
    return _layout(rows // (k + 1), k, seed)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_moe_every_verify_plan(version):
    """v1 (the drop-in) and v2 (repacked layers): the plan of every verify row class at TP4, on verify
    rows of small-dim experts, against fp64."""
    from v4flash_kernels.kit.compare import rel_err as moe_err
    from v4flash_kernels.moe import op as v1
    from v4flash_kernels.moe import repacked_op as v2
    from v4flash_kernels.moe.reference import ref_of
    from v4flash_kernels.moe.repack import repack_experts

    for rows, label in _class_rows(MOE[version]):
        plan = (v1 if version == "v1" else v2).make_plan(rows, V.MOE["topk"], V.MOE["experts"], V.MOE["hidden"],
                                                         V.MOE["inter"])
        assert plan.name == label
        kw = _moe_inputs(_rows_layout(min(rows, MOE_MAX_ROWS), seed=80 + rows), seed=81 + rows)
        out = torch.full_like(kw["hidden_states"], float("nan"))
        if version == "v1":
            v1.run(kw["hidden_states"], kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"],
                   kw["topk_ids"], kw["topk_weights"], kw["intermediate_size"], kw["routed_scaling_factor"],
                   kw["clamp_limit"], plan=plan, out=out)
        else:
            experts = repack_experts(kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"])
            v2.run_repacked(kw["hidden_states"], experts, kw["topk_ids"], kw["topk_weights"],
                            kw["routed_scaling_factor"], kw["clamp_limit"], plan=plan, out=out)
        assert not torch.isnan(out.float()).any(), label
        assert moe_err(out, ref_of(kw)) <= 1e-2, label


def test_moe_matches_upstream_on_verify_rows():
    """2 requests x 2 rows (k = 1): v1, v2 and the wheel's `mxfp4_moe_forward_triton` (under the
    interpreter, one autotune config) against fp64 and each other."""
    from v4flash_kernels.kit.compare import rel_err as moe_err
    from v4flash_kernels.moe import op as v1
    from v4flash_kernels.moe.reference import ref_of
    from v4flash_kernels.moe.repack import repack_experts
    from v4flash_kernels.moe.repacked_op import moe_forward_repacked
    from v4flash_kernels.upstream import MOE_PATH, load_module

    up = load_module(MOE_PATH)
    kern = up._mxfp4_slot_gemv_kernel
    kern.configs = kern.configs[1:2] if len(kern.configs) > 1 else kern.configs
    kw = _moe_inputs(_layout(2, 1, seed=90), seed=91)
    ref = ref_of(kw)
    ours = v1.mxfp4_moe_forward(**kw)
    experts = repack_experts(kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"])
    ours2 = moe_forward_repacked(kw["hidden_states"], experts, kw["topk_ids"], kw["topk_weights"],
                                 kw["routed_scaling_factor"], kw["clamp_limit"])
    theirs = up.mxfp4_moe_forward_triton(**kw)
    assert moe_err(ours, ref) <= 1e-2 and moe_err(ours2, ref) <= 1e-2
    # upstream rounds through bf16 buffers and the interpreter's fp32 -> bf16 cast truncates: ~1 %
    assert moe_err(theirs, ref) <= 3e-2 and moe_err(ours, theirs.double()) <= 3e-2


# ----------------------------------------------------------------------------- mHC


def test_mhc_every_verify_plan_and_the_wheels_torch_path():
    """The pre, post and fused post+pre on each class's fewest verify rows with its binary (one or two
    launches, tokens per block, warps; the hidden split scaled to this hidden size), against fp64; the
    drop-ins against the wheel's sm_120 torch path (its TileLang Sinkhorn stood in by the reference split,
    as in test_mhc_cpu)."""
    from v4flash_kernels.mhc import checks as C
    from v4flash_kernels.mhc import op as mh
    from v4flash_kernels.mhc import reference as R
    from v4flash_kernels.mhc import upstream as U

    p = R.MhcParams()
    hidden = 256
    common = {"rms_eps": p.rms_eps, "hc_eps": p.pre_eps, "sinkhorn_iters": p.iters}
    for rows, label in _class_rows(MHC):
        big = mh.plan_for(rows, 4096, V.H200.sms)
        assert big.name == label
        plan = mh.make_plan(big.block_t, big.splits, big.block_h, hidden, big.num_warps, tokens=big.tokens)
        kw = R.make_inputs(R.MhcCase(tokens=rows, hidden=hidden), seed=rows)
        ref = R.pre_ref(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], p)
        y, post, comb = mh.mhc_pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"], **common, plan=plan)
        res = C.check_pre(y, post, comb, ref, R.layer_input_ref(ref["y"], None, p.norm_eps), C.TOL)
        assert res["ok"], (rows, label, res)
        full = R.post_pre_ref(kw, p)
        cur, y, post, comb = mh.mhc_post_pre(kw["x"], kw["residual"], kw["post"], kw["comb"], kw["hc_fn"],
                                             kw["hc_scale"], kw["hc_base"], **common,
                                             norm_weight=kw["norm_weight"], norm_eps=p.norm_eps, plan=plan)
        assert C.check_streams(cur, full["residual"], C.TOL)["ok"], (rows, label)
        assert C.check_pre(y, post, comb, full, full["layer_input"], C.TOL)["ok"], (rows, label)
        out = mh.mhc_post(kw["x"], kw["residual"], kw["post"], kw["comb"])
        assert C.check_streams(out, R.post_ref(kw["x"], kw["residual"], kw["post"], kw["comb"]), C.TOL)["ok"]
    layer = SimpleNamespace(hc_mult=4, hc_sinkhorn_iters=p.iters, hc_eps=p.pre_eps, rms_norm_eps=p.rms_eps)
    up = U.UpstreamSm120(p, kind="torch")
    kw = R.make_inputs(R.MhcCase(tokens=12, hidden=hidden), seed=5)
    uy, upost, ucomb, _ = up.pre(kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"])
    oy, opost, ocomb, onorm = mh.hc_pre(layer, kw["residual"], kw["hc_fn"], kw["hc_scale"], kw["hc_base"])
    assert onorm is False
    assert R.max_rel(oy, uy.double()) <= C.TOL["bf16"]
    assert R.max_abs(opost, upost) <= C.TOL["mix"] and R.max_abs(ocomb, ucomb) <= C.TOL["mix"]
    uout = up.post(kw["x"], kw["residual"], kw["post"], kw["comb"])
    oout = mh.hc_post(layer, kw["x"], kw["residual"], kw["post"], kw["comb"])
    assert R.max_rel(oout, uout.double()) <= C.TOL["bf16"]
