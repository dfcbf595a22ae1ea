"""GPU tests (H200): every patched op at the verify shapes the decode worker captures with speculative decoding on.

With EAGLE (top-k 1, k = 1..3 draft steps) SGLang captures one TARGET_VERIFY CUDA graph per batch size
of its speculative list (1..8, 10..32 step 2, 40..64 step 4 up to the default profile's --cuda-graph-max-bs
64; read from the pinned wheel at run time), each with R = bs x (k + 1) rows: R = 2..256. Which plans change
with R is in test_verify_shapes_cpu.py's docstring (and pinned there); here, per op, the planner's
plan at every captured (bs, k) is computed for this GPU and, for each distinct plan, the captured
(bs, k) with the fewest and with the most rows that take it runs at DeepSeek-V4-Flash's TP4 shapes
(128K context):

- sparse-MLA decode, SWA / c4 / c128@128K layers: SGLang's TP4 call (a 64-head q, this rank's 16 heads
  real, the other 48 NaN/Inf; the TP adapter), rows of one request sharing their caches and page table;
- indexer logits (64 heads, 32768 c4 positions per row's table) and the top-512 (in-graph form: no
  raw positions) on those rows' shared tables;
- the five block-FP8 linears (wqkv_a, wq_b, wo_b, shared gate_up, shared down) through the drop-in;
- the MXFP4 MoE, v1 (drop-in) and v2 (repacked experts), 256 experts, top-6, TP4 intermediate 512;
- mHC: `hc_pre`, `hc_post` and the fused post+pre drop-ins at hidden 4096.

Each case draws verify batch A and runs the op once (compile, warm), captures the call in a CUDA
graph, draws batch B of the same (bs, k) (new committed lengths, so new lengths, indices, page tables;
new contents), copies it into the graph's inputs, poisons the outputs, replays, and checks against
fp64 on B.

Run from the repository root (no sglang install needed; the wheel is read for the capture list):

    PYTHONPATH=kernels V4FLASH_SGLANG_WHEEL=.cache/wheels/sglang-0.5.13.post1-cp311-cp311-manylinux_2_34_x86_64.whl \\
        python -m pytest -q -m gpu tests/kernels/test_verify_shapes_gpu.py --durations=10
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List

import pytest
import torch
import verify_rows as V

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _gpu() -> V.Gpu:
    """This device's SM count and shared memory per SM (the H200's when collected without a GPU)."""
    if not torch.cuda.is_available():
        return V.H200
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or (102400 if props.major == 12 else 233472)
    return V.Gpu(props.name, props.multi_processor_count, int(smem))


GPU = _gpu()
try:
    SHAPES = V.verify_shapes(V.spec_capture_bs())
    NO_WHEEL = ""
except FileNotFoundError as exc:  # collected on a machine without the pinned wheel (CPU CI deselects these)
    SHAPES, NO_WHEEL = (), str(exc)


def test_gpu_capture_list_read_from_the_wheel():
    """Without the pinned wheel every case list below is empty: this fails instead of passing quietly."""
    assert not NO_WHEEL, NO_WHEEL
    assert SHAPES


def _cases(label: Callable[[int], str]) -> List:
    """pytest params: for each distinct plan label over the captured verify sizes, its fewest-rows and
    most-rows (bs, k)."""
    out = []
    for lab, picks in V.cover(SHAPES, label).items():
        out += [pytest.param(bs, k, lab, id=f"bs{bs}-k{k}-R{rows}") for bs, k, rows in picks]
    return out


def _batches(bs: int, k: int, seed: int):
    """Verify batches A (captured: uniform lengths) and B (replayed and checked: its first requests'
    rows across the edges) of the same (bs, k), their layouts sharing one pool size (the graph's buffers)."""
    g = torch.Generator().manual_seed(seed)
    a, b = V.draw_batch(bs, k, V.CONTEXT, g, edges=False), V.draw_batch(bs, k, V.CONTEXT, g)
    assert a != b
    pages = max(V.pages_needed(a), V.pages_needed(b))
    return V.make_layout(a, V.CONTEXT, g, DEVICE, num_pages=pages), V.make_layout(b, V.CONTEXT, g, DEVICE, num_pages=pages)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _replay(call: Callable, static: Dict, fresh: Dict, poison: Callable | None = None):
    """Warm `call` on a side stream (as SGLang warms before capture), capture it, copy `fresh`'s tensors
    into `static`'s (same shapes), run `poison(outputs)`, replay; returns the graph's outputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = call()
    for key, val in fresh.items():
        if isinstance(val, torch.Tensor):
            assert static[key].shape == val.shape, key
            static[key].copy_(val)
    if poison is not None:
        poison(outs)
    g.replay()
    torch.cuda.synchronize()
    return outs


# ----------------------------------------------------------------------------- sparse-MLA decode


ATTN_CASES = [pytest.param(kind, *p.values, id=f"{kind}-{p.id}") for kind in ("swa", "c4", "c128")
              for p in _cases(partial(V.attention_label, kind=kind, gpu=GPU))]


@pytest.mark.parametrize("kind,bs,k,label", ATTN_CASES)
def test_gpu_attention_verify_graph(kind, bs, k, label):
    from v4flash_kernels.attention import op as decode
    from v4flash_kernels.attention.reference import sparse_mla_decode_ref
    from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware
    from v4flash_kernels.kit.compare import rel_err

    fn = make_tp_aware(decode.sparse_mla_decode, read=lambda: AttnTp(1, 4))
    lay_a, lay_b = _batches(bs, k, seed=bs * 10 + k)
    static, keep = V.tp4_query(V.attention_inputs(lay_a, kind, V.HEADS_PER_RANK, _gen(1), DEVICE), rank=1)
    kw_b = V.attention_inputs(lay_b, kind, V.HEADS_PER_RANK, _gen(2), DEVICE)
    fresh, _ = V.tp4_query(kw_b, rank=1)

    def poison(outs):
        outs[0][:, :, keep].fill_(float("nan"))
        outs[1][:, keep].fill_(float("nan"))

    out, lse = _replay(lambda: fn(**static), static, fresh, poison)
    ref_out, ref_lse = sparse_mla_decode_ref(**kw_b)
    mine, ml = out[:, :, keep], lse[:, keep]
    assert not torch.isnan(mine.float()).any() and not torch.isnan(ml).any(), label
    assert rel_err(mine, ref_out) <= 1e-2, label
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(ml), fin), label
    assert (ml.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-2, label


# ----------------------------------------------------------------------------- indexer logits and top-512


@pytest.mark.parametrize("bs,k,label", _cases(lambda r: V.indexer_label(r, GPU)))
def test_gpu_indexer_verify_graph(bs, k, label):
    from v4flash_kernels.indexer import op as ix
    from v4flash_kernels.indexer.reference import logits_error, reference_for

    lay_a, lay_b = _batches(bs, k, seed=100 + bs * 10 + k)
    static = V.indexer_inputs(lay_a, _gen(3), DEVICE)
    fresh = V.indexer_inputs(lay_b, _gen(4), DEVICE)
    out = _replay(lambda: ix.fp8_paged_mqa_logits(*static.values()), static, fresh,
                  poison=lambda o: o.fill_(float("nan")))
    e = logits_error(out, reference_for(fresh))
    assert not e["nan"] and e["inf_ok"] and e["rel_err"] <= 1e-5, (label, e)


@pytest.mark.parametrize("bs,k,label", _cases(lambda r: V.topk_label(r, GPU)))
def test_gpu_topk_verify_graph(bs, k, label):
    from v4flash_kernels.topk import op as tk
    from v4flash_kernels.topk.reference import topk_transform_ref

    lay_a, lay_b = _batches(bs, k, seed=200 + bs * 10 + k)
    static = V.topk_inputs(lay_a, V.verify_scores(lay_a, _gen(5), DEVICE), raw=False)
    fresh = V.topk_inputs(lay_b, V.verify_scores(lay_b, _gen(6), DEVICE), raw=False)
    _replay(lambda: tk.topk_transform_512(*static.values()), static,
            {k_: v for k_, v in fresh.items() if k_ != "out_page_indices"},
            poison=lambda _: static["out_page_indices"].fill_(-7))
    want, _ = topk_transform_ref(fresh["scores"], fresh["seq_lens"], fresh["page_tables"], V.C4_TOPK, V.C4_PAGE)
    got = static["out_page_indices"].cpu()
    bad = [r for r in range(got.shape[0]) if not torch.equal(got[r], want[r])]
    assert not bad, (label, bad[:8])


# ----------------------------------------------------------------------------- FP8 linears


FP8_RTOL = 2.0 ** -8  # the bf16 output's round to nearest (as test_fp8_gemm_gpu)
FP8_ATOL_MAG = 2.0 ** -10  # the fp8 MMAs' accumulation bound (test_fp8_gemm_gpu.ATOL_MAG says how it was measured)
FP8_CASES = [pytest.param(shape, *p.values, id=f"{shape}-{p.id}")
             for shape in V.FP8_SHAPES for p in _cases(partial(V.fp8_label, shape=shape, gpu=GPU))]


@pytest.mark.parametrize("shape,bs,k,label", FP8_CASES)
def test_gpu_fp8_linear_verify_graph(shape, bs, k, label):
    from v4flash_kernels.fp8_gemm import op as f8
    from v4flash_kernels.fp8_gemm.reference import linear_ref, make_activation, make_weight
    from v4flash_kernels.kit.compare import excess_error

    n, kd = V.FP8_SHAPES[shape]
    rows = bs * (k + 1)
    assert f8.plan(rows, n, kd, GPU.sms).name == label
    g = _gen(300 + rows)
    w, ws = make_weight(n, kd, g, DEVICE)
    static = {"x": make_activation(rows, kd, g, DEVICE), "w": w, "ws": ws}
    w2, ws2 = make_weight(n, kd, g, DEVICE)
    fresh = {"x": make_activation(rows, kd, g, DEVICE), "w": w2, "ws": ws2}
    out = _replay(lambda: f8.w8a8_block_fp8_linear(static["x"], static["w"], [128, 128], static["ws"]), static, fresh,
                  poison=lambda o: o.fill_(float("nan")))
    ref, mag = linear_ref(fresh["x"], fresh["w"], fresh["ws"])
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    assert excess_error(out, ref, mag, FP8_RTOL, FP8_ATOL_MAG) <= 1.0, label


# ----------------------------------------------------------------------------- MXFP4 MoE


@pytest.fixture(scope="module")
def tp4_experts():
    """One set of TP4 expert weights on the GPU (as test_moe_gpu draws them), fp32 power-of-two scales,
    and its repacked form."""
    from v4flash_kernels.moe.repack import repack_experts

    E, H, inter = V.MOE["experts"], V.MOE["hidden"], V.MOE["inter"]
    g = _gen(20261202)

    def r(shape, lo, hi):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device=DEVICE, generator=g)

    w13, w2 = r((E, 2 * inter, H // 2), 0, 256).view(torch.int8), r((E, H, inter // 2), 0, 256).view(torch.int8)
    s13 = r((E, 2 * inter, H // 32), 118, 123).view(torch.float8_e8m0fnu).to(torch.float32)
    s2 = r((E, H, inter // 32), 118, 123).view(torch.float8_e8m0fnu).to(torch.float32)
    return {"w13_packed": w13, "w2_packed": w2, "w13_scale": s13, "w2_scale": s2,
            "experts": repack_experts(w13, w2, s13, s2)}


def _routing(lay: V.Layout, seed: int) -> Dict:
    """Each request's rows route around one shared set of experts; a tenth of the slots dropped (-1)."""
    b = lay.batch
    g = _gen(seed)
    E = V.MOE["experts"]
    base = torch.rand((b.requests, E), generator=g, device=DEVICE)[b.request_of_row().to(DEVICE)]
    ids = (base + 0.3 * torch.rand((b.rows, E), generator=g, device=DEVICE)).topk(V.MOE["topk"], dim=1).indices
    ids = torch.where(torch.rand(ids.shape, generator=g, device=DEVICE) < 0.1, -1, ids).to(torch.int32)
    return {"hidden_states": torch.randn((b.rows, V.MOE["hidden"]), generator=g, device=DEVICE).to(torch.bfloat16),
            "topk_ids": ids, "topk_weights": torch.softmax(torch.randn(ids.shape, generator=g, device=DEVICE), dim=1)}


MOE_CASES = [pytest.param(v, *p.values, id=f"{v}-{p.id}") for v in ("v1", "v2")
             for p in _cases(partial(V.moe_label, version=v))]


@pytest.mark.parametrize("version,bs,k,label", MOE_CASES)
def test_gpu_moe_verify_graph(tp4_experts, version, bs, k, label):
    from v4flash_kernels.kit.compare import rel_err
    from v4flash_kernels.moe import op as v1
    from v4flash_kernels.moe.reference import ref_of
    from v4flash_kernels.moe.repacked_op import moe_forward_repacked

    scaling, clamp = 1.5, 10.0
    lay_a, lay_b = _batches(bs, k, seed=400 + bs * 10 + k)
    static, fresh = _routing(lay_a, 7), _routing(lay_b, 8)
    w = tp4_experts

    def call():
        if version == "v1":
            return v1.mxfp4_moe_forward(static["hidden_states"], w["w13_packed"], w["w2_packed"], w["w13_scale"],
                                        w["w2_scale"], static["topk_ids"], static["topk_weights"], V.MOE["hidden"],
                                        V.MOE["inter"], False, scaling, clamp)
        return moe_forward_repacked(static["hidden_states"], w["experts"], static["topk_ids"], static["topk_weights"],
                                    scaling, clamp)

    out = _replay(call, static, fresh, poison=lambda o: o.fill_(float("nan")))
    rows = lay_b.batch.rows
    tokens = None  # all rows up to 24, else the first request's and a random 20-odd others (the fp64 loop's cost)
    if rows > 24:
        rest = torch.randperm(rows - k - 1, generator=torch.Generator().manual_seed(rows))[: 24 - k - 1] + k + 1
        tokens = torch.cat([torch.arange(k + 1), rest]).sort().values.to(DEVICE)
    kw = {**fresh, "w13_packed": w["w13_packed"], "w2_packed": w["w2_packed"], "w13_scale": w["w13_scale"],
          "w2_scale": w["w2_scale"], "intermediate_size": V.MOE["inter"], "routed_scaling_factor": scaling,
          "clamp_limit": clamp}
    assert not torch.isnan(out.float()).any(), label
    assert rel_err(out if tokens is None else out[tokens], ref_of(kw, tokens)) <= 1e-2, label


# ----------------------------------------------------------------------------- mHC


@pytest.mark.parametrize("bs,k,label", _cases(lambda r: V.mhc_label(r, GPU)))
def test_gpu_mhc_verify_graph(bs, k, label):
    from types import SimpleNamespace

    from v4flash_kernels.mhc import checks as C
    from v4flash_kernels.mhc import op as mh
    from v4flash_kernels.mhc import reference as R

    p = R.MhcParams()
    rows = bs * (k + 1)
    assert mh.plan_for(rows, 4096, GPU.sms).name == label
    static = R.make_inputs(R.MhcCase(tokens=rows), device=DEVICE, seed=rows)
    fresh = R.make_inputs(R.MhcCase(tokens=rows), device=DEVICE, seed=1000 + rows)
    layer = SimpleNamespace(hc_mult=4, hc_sinkhorn_iters=p.iters, hc_eps=p.pre_eps, rms_norm_eps=p.rms_eps)

    def call():
        s = static
        pre = mh.hc_pre(layer, s["residual"], s["hc_fn"], s["hc_scale"], s["hc_base"])
        post = mh.hc_post(layer, s["x"], s["residual"], s["post"], s["comb"])
        fused = mh.mhc_fused_post_pre(s["x"], s["residual"], s["post"].unsqueeze(-1), s["comb"], s["hc_fn"],
                                      s["hc_scale"], s["hc_base"], p.rms_eps, p.pre_eps, p.sinkhorn_eps, p.post_mult,
                                      p.iters, norm_weight=s["norm_weight"], norm_eps=p.norm_eps)
        return pre, post, fused

    def poison(outs):
        for t in (*outs[0][:3], outs[1], *outs[2]):
            t.fill_(float("nan"))

    (y, post, comb, _), streams, (cur, fpost, fcomb, li) = _replay(call, static, fresh, poison)
    f = fresh
    ref = R.pre_ref(f["residual"], f["hc_fn"], f["hc_scale"], f["hc_base"], p)
    res = C.check_pre(y, post, comb, ref, R.layer_input_ref(ref["y"], None, p.norm_eps), C.TOL)
    assert res["ok"], (label, res)
    assert C.check_streams(streams, R.post_ref(f["x"], f["residual"], f["post"], f["comb"]), C.TOL)["ok"], label
    # the fused pre against the fp64 pre of exactly the bf16 streams it wrote (the unfused pair's input)
    res = C.check_post_pre(cur, li, fpost.view(rows, 4), fcomb, f, p, C.TOL)
    assert res["ok"], (label, res)
