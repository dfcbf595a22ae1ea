"""GPU tests (run on the H200 through the device tool): real shapes, CUDA graphs, upstream parity."""

from __future__ import annotations

import pytest
import torch

from v4flash_bench.attention import KINDS
from v4flash_kernels.attention.reference import Case, make_inputs, sparse_mla_decode_ref
from v4flash_kernels.kit.compare import rel_err

pytestmark = pytest.mark.gpu


def _poisoned_call(kw):
    from v4flash_kernels.attention import op as decode

    B, _, H, D = kw["q"].shape
    out = torch.full((B, 1, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, 1, H), float("nan"), dtype=torch.float32, device="cuda")
    return decode.run(
        kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"], kw["softmax_scale"],
        kw.get("extra_k_cache"), kw.get("extra_indices"), kw.get("extra_topk_length"), out=out, lse=lse,
    )


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("batch,heads", [(1, 64), (5, 64), (64, 64), (3, 16), (64, 16)])
def test_gpu_matches_reference_and_upstream(kind, batch, heads):
    from v4flash_kernels.upstream import load_upstream

    kw = make_inputs(Case(batch=batch, heads=heads, fp8_view=batch == 5, **KINDS[kind]), device="cuda")
    out, lse = _poisoned_call(kw)
    ref_out, ref_lse = sparse_mla_decode_ref(**kw)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    assert rel_err(out, ref_out) <= 1e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-2
    up_out, up_lse = load_upstream().flash_mla_sparse_decode_triton(**kw)
    assert rel_err(out, up_out) <= 1e-2
    up_lse = up_lse.float()
    assert torch.equal(torch.isfinite(lse), torch.isfinite(up_lse))
    fin = torch.isfinite(lse)
    assert torch.allclose(lse[fin], up_lse[fin], atol=1e-2, rtol=0)


def test_gpu_cuda_graph_replay_follows_new_lengths_and_indices():
    """Captured once, replayed after the index/length *contents* change: still exact."""
    from v4flash_kernels.attention.op import sparse_mla_decode

    case = Case(batch=4, heads=64, **KINDS["c4"])
    kw = make_inputs(case, device="cuda", seed=1)
    fresh = make_inputs(case, device="cuda", seed=2)
    sparse_mla_decode(**kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = sparse_mla_decode(**kw)
    for key in ("q", "indices", "topk_length", "extra_indices", "extra_topk_length"):
        kw[key].copy_(fresh[key])
    fresh["k_cache"], fresh["extra_k_cache"], fresh["attn_sink"] = kw["k_cache"], kw["extra_k_cache"], kw["attn_sink"]
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref_out, _ = sparse_mla_decode_ref(**fresh)
    assert not torch.isnan(out.float()).any()
    assert rel_err(out, ref_out) <= 1e-2


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("batch,rank", [(1, 0), (4, 3), (64, 1)])
def test_gpu_tp4_production_call_matches_reference_and_upstream(kind, batch, rank):
    """SGLang's TP4 call: 64-head q, this rank's 16 real, the other 48 NaN/Inf/3e38, through the adapter."""
    from v4flash_bench.attention import poison_other_heads, ref_inputs
    from v4flash_kernels.attention import op as decode
    from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware
    from v4flash_kernels.upstream import load_upstream

    kw = make_inputs(Case(batch=batch, heads=64, **KINDS[kind]), device="cuda")
    keep = slice(16 * rank, 16 * rank + 16)
    poison_other_heads(kw["q"], keep)
    ref_out, ref_lse = sparse_mla_decode_ref(**ref_inputs(kw, keep))
    out, lse = make_tp_aware(decode.sparse_mla_decode, read=lambda: AttnTp(rank, 4))(**kw)
    mine, ml = out[:, :, keep], lse[:, keep]
    assert not torch.isnan(mine.float()).any() and not torch.isnan(ml).any()
    assert rel_err(mine, ref_out) <= 1e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(ml), fin)
    assert (ml.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-2
    up_out, _ = load_upstream().flash_mla_sparse_decode_triton(**ref_inputs(kw, keep))
    assert rel_err(mine, up_out) <= 1e-2


@pytest.mark.parametrize("kind,batch,one_launch", [("c4", 1, True), ("c4", 4, True), ("c128@256K", 1, True),
                                                   ("swa", 1, False), ("c4", 64, False)])
def test_gpu_graph_replays_are_identical_and_follow_new_inputs(kind, batch, one_launch):
    """TP4 slice, planner's plan (or the same plan with the cooperative one-launch merge): 50 replays
    bit-identical, then new contents -> still exact (the merge counters reset themselves)."""
    from v4flash_bench.attention import bind_plan, cache_widths, ref_inputs
    from v4flash_kernels.attention import op as decode

    case = Case(batch=batch, heads=64, **KINDS[kind])
    kw = make_inputs(case, device="cuda", seed=11)
    fresh = make_inputs(case, device="cuda", seed=12)
    w_a, w_b = cache_widths(kw)
    plan = decode.make_plan(batch, 16, w_a, w_b, decode._num_sms(kw["q"].device), fused=one_launch)
    if one_launch:
        assert decode.coop_fits(plan.num_splits * batch, decode._num_sms(kw["q"].device))
    fn = bind_plan(plan, (32, 48))
    fn(**kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = fn(**kw)
    g.replay()
    torch.cuda.synchronize()
    first = out[:, :, 32:48].clone()
    for _ in range(50):
        out[:, :, 32:48].fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:, :, 32:48], first)
    for key in ("q", "indices", "topk_length") + (("extra_indices", "extra_topk_length") if "extra_indices" in kw else ()):
        kw[key].copy_(fresh[key])
    for key in ("k_cache", "extra_k_cache", "attn_sink"):
        if key in kw:
            fresh[key] = kw[key]
    g.replay()
    torch.cuda.synchronize()
    ref_out, _ = sparse_mla_decode_ref(**ref_inputs(fresh, slice(32, 48)))
    assert rel_err(out[:, :, 32:48], ref_out) <= 1e-2
