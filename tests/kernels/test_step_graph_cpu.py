"""The whole-step graph's schedule (pure): every call of every op of a decode step lands in a layer of
its kind, once, in step order; a count that does not divide spreads over the first layers."""

from __future__ import annotations

import pytest

from v4flash_bench.step import model as M
from v4flash_bench.step import stepgraph as SG

K = 1024


@pytest.mark.parametrize("path", ["upstream", "patched"])
@pytest.mark.parametrize("batch", [1, 64])
def test_every_call_of_the_step_is_scheduled_once_in_a_layer_of_its_kind(path, batch):
    spec = M.StepSpec("decode", batch, 128 * K, 8 * K, heads_patched=16)
    ops = M.ops_for_path(M.step_ops(spec), path)
    order = SG.schedule(ops)
    kinds = M.layer_kinds()
    calls: dict = {}
    for layer, op, n in order:
        assert 0 <= layer < M.N_LAYERS and n >= 1
        calls[(op.name, op.key)] = calls.get((op.name, op.key), 0) + n
        kind = op.p.get("kind")
        if kind in SG.KINDS:
            assert kinds[layer] == kind, (op.name, layer)
    assert calls == {(op.name, op.key): op.count for op in ops if op.count > 0}
    assert [layer for layer, _o, _n in order] == sorted(layer for layer, _o, _n in order), "layer after layer"


def test_c4_only_ops_run_in_the_21_c4_layers_and_mhc_boundaries_spread():
    spec = M.StepSpec("decode", 1, 128 * K, 8 * K, heads_patched=16)
    order = SG.schedule(M.ops_for_path(M.step_ops(spec), "patched"))
    kinds = M.layer_kinds()
    idx = [layer for layer, op, _n in order if op.name.startswith("indexer logits")]
    assert idx == [i for i, k in enumerate(kinds) if k == "c4"]
    fused = {layer: n for layer, op, n in order if op.p.get("kind") == "fused"}
    assert sum(fused.values()) == 2 * M.N_LAYERS - 1 and fused[M.N_LAYERS - 1] == 1 and fused[0] == 2


def test_impl_follows_the_path_and_a_missing_patch_runs_upstream():
    from v4flash_bench.step.results import Measurement

    spec = M.StepSpec("decode", 1, 128 * K, 8 * K, heads_patched=16)
    moe = next(o for o in M.step_ops(spec) if o.name.startswith("routed MoE"))
    ok = Measurement(moe.key, "ours", moe.name, 1.0, 1, 1, True, 0.0, "", "")
    missing = Measurement(moe.key, "ours", moe.name, float("nan"), 0, 0, True, float("nan"), "", "", error="no patch")
    assert SG.impl_of(moe, "patched", {(moe.key, "ours"): ok}) == "ours"
    assert SG.impl_of(moe, "upstream", {(moe.key, "ours"): ok}) == "upstream"
    assert SG.impl_of(moe, "patched", {(moe.key, "ours"): missing}) == "upstream"
