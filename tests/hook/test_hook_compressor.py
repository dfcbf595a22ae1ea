"""The compressor patch against the real pinned sglang 0.5.13.post1 wheel, each scenario in a fresh interpreter.

On CUDA sglang runs the compressors through `compressor_v2.CompressorBackendMixin.forward_unified`, which
the attention backend inherits under two class attributes (`forward_core_compressor`, called by the
model, and `forward_indexer_compressor`, called by the indexer). The patch replaces both; the backend
finds them through its class at call time.

The consumer scenario builds the wheel's own `Compressor` (its `__init__`, its `apply_ape_hotfix`, its
`get_state_pool`) and the memory pool's real classes (`DeepSeekV4TokenToKVPool`, `DeepSeekV4SingleKVPool`,
`DeepSeekV4IndexerPool`, `CompressStatePool`, filled with the step's tensors instead of allocating a
server's pools), with a backend whose class is the real mixin and a real `CompressorDecodePlan`, and
calls the backend's method as the model and the indexer do, on CPU under TRITON_INTERPRET=1. With the
switch on, a decode step enters ours only and leaves the ring and the cache as the fp64 reference says;
an idle batch, a prefill plan and 17 rows enter upstream's `forward_unified` (the idle one returns, the
others reach upstream's cuBLAS GEMM / JIT kernels, which cannot run on this CPU box: that error is
upstream's, raised inside upstream's function). With the switch off, upstream's function is the one entered.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.compressor import reference as R
from v4flash_kernels.hook import patches

V2 = "sglang.srt.layers.attention.dsv4.compressor_v2"
SPECS = patches.patches_of("compressor")
OURS = "v4flash_kernels.compressor.op.forward_unified"

IDENTITY = """
import importlib, json
mod = importlib.import_module("sglang.srt.layers.attention.dsv4.compressor_v2")
from v4flash_kernels.hook import hook, patches
from v4flash_kernels.compressor import op
mixin = mod.CompressorBackendMixin
seen = {"core": mixin.forward_core_compressor is op.forward_unified,
        "indexer": mixin.forward_indexer_compressor is op.forward_unified,
        "unified_is_upstream": mixin.forward_unified is not op.forward_unified,
        "upstream_kept": getattr(mod, "_v4flash_upstream_CompressorBackendMixin.forward_core_compressor", None)
                         is mixin.forward_unified}
st = {p.name: hook.patch_status(p.name) for p in patches.patches_of("compressor")}
print("PROBE-JSON " + json.dumps({"seen": seen, "status": st}, default=str))
"""

CONSUMER = """
import importlib, json, os, sys, warnings
from types import SimpleNamespace
warnings.filterwarnings("ignore")

from v4flash_kernels.interpreter import fix_index  # numpy >= 2.4 vs Triton 3.6's interpreter
fix_index()

import torch
cv2 = importlib.import_module("sglang.srt.layers.attention.dsv4.compressor_v2")
comp = importlib.import_module("sglang.srt.layers.attention.dsv4.compressor")
from sglang.jit_kernel.dsv4 import CompressorDecodePlan, CompressorPrefillPlan
from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool, KVAndScore
from sglang.srt.mem_cache.deepseek_v4_memory_pool import (DeepSeekV4IndexerPool, DeepSeekV4SingleKVPool,
                                                           DeepSeekV4TokenToKVPool)
from v4flash_kernels.compressor.reference import make_case
from v4flash_kernels.hook import hook

ratio, hd, rows, seed, scenario, out_path = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                             sys.argv[5], sys.argv[6])
indexer = hd == 128
case = make_case(rows, ratio, hd, 256, seed)
coff = 2 if ratio == 4 else 1

# the wheel's Compressor, its parameters loaded as a checkpoint would (ape before apply_ape_hotfix)
cfg = SimpleNamespace(hidden_size=256, rms_norm_eps=case["eps"], qk_rope_head_dim=64)
c = comp.Compressor(cfg, layer_id=0, is_in_indexer=indexer, freqs_cis=case["freqs_cis"], compress_ratio=ratio,
                    head_dim=hd, rotate=indexer)
with torch.no_grad():
    c.wkv_gate.weight.copy_(case["weight"])
    ape = case["ape"]
    c.ape.copy_(torch.cat([ape[:ratio], ape[ratio:]], 1) if coff == 2 else ape)
    c.norm.weight.copy_(case["norm_weight"])
c.apply_ape_hotfix()

# the memory pool's classes, holding this step's tensors (no server-sized allocation)
state_pool = CompressStatePool.__new__(CompressStatePool)
state_pool.kv_score_buffer = KVAndScore(case["state"])
pool = DeepSeekV4TokenToKVPool.__new__(DeepSeekV4TokenToKVPool)
pool.layer_transfer_counter = None
if indexer:
    ipool = DeepSeekV4IndexerPool.__new__(DeepSeekV4IndexerPool)
    ipool.index_k_with_scale_buffer, ipool.page_size = [case["cache"]], case["page_size"]
    pool.c4_indexer_kv_pool = ipool
    pool.indexer_compress_state_pools = [state_pool]
    pool.layer_mapping = [(4, 0, None)]
else:
    kv_pool = DeepSeekV4SingleKVPool.__new__(DeepSeekV4SingleKVPool)
    kv_pool.kv_buffer, kv_pool.page_size, kv_pool.start_layer = [case["cache"]], case["page_size"], 0
    kv_pool.store_dtype, kv_pool.dtype = torch.uint8, torch.float8_e4m3fn
    pool.compress_state_pools = [state_pool]
    pool.layer_mapping = [(ratio, 0, kv_pool)]

class Backend(cv2.CompressorBackendMixin):
    def __init__(self, plan, out_loc):
        self.token_to_kv_pool = pool
        self.enable_deepseek_v4_fp4_indexer = False
        core = SimpleNamespace(**{f"c{ratio}_out_loc": out_loc})
        self.forward_metadata = SimpleNamespace(core_metadata=core, **{f"c{ratio}_compress_metadata": plan})

plan_d = case["plan_d"].view(torch.uint8)
x, out_loc = case["x"], case["out_loc"]
if scenario == "prefill":
    plan = CompressorPrefillPlan(ratio, torch.zeros((rows, 16), dtype=torch.uint8),
                                 torch.zeros((rows, 8), dtype=torch.uint8))
else:
    plan = CompressorDecodePlan(ratio, plan_d)
if scenario == "rows17":
    x = torch.cat([x] * 17)[:17]
backend = Backend(plan, out_loc)
idle = scenario == "idle"
batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: idle, is_decode=lambda: True), attn_cp_metadata=None)

who = {("v4flash_kernels/compressor/op.py", "forward_unified"): "ours",
       ("v4flash_kernels/compressor/kernel.py", "compressor_decode_kernel"): "ours.kernel",
       ("attention/dsv4/compressor_v2.py", "forward_unified"): "upstream",
       ("attention/dsv4/compressor.py", "compute_kv_score"): "upstream.gemm"}
entered = []
def prof(frame, event, arg):
    if event == "call":
        fname = frame.f_code.co_filename.replace(os.sep, "/")
        for (suffix, name), w in who.items():
            if frame.f_code.co_name == name and fname.endswith(suffix) and (not entered or entered[-1] != w):
                entered.append(w)
error = None
sys.setprofile(prof)
try:
    if indexer:  # as the indexer calls it
        backend.forward_indexer_compressor(x=x, forward_batch=batch, layer_id=0, compressor=c)
    else:  # as the model calls it
        backend.forward_core_compressor(x, batch, 0, c)
except Exception as exc:
    error = f"{type(exc).__name__}: {str(exc)[:200]}"
finally:
    sys.setprofile(None)
torch.save({"state": case["state"], "cache": case["cache"]}, out_path)
active = {s: hook.patch_status(s)["active"] for s in ("compressor_core", "compressor_indexer")}
print("PROBE-JSON " + json.dumps({"entered": entered, "error": error, "status": active}, default=str))
"""

ENV = {"TRITON_INTERPRET": "1"}
KINDS = [(4, 512), (128, 512), (4, 128)]


def _consumer(hook_env, tmp_path, ratio, hd, rows, scenario, env):
    out = tmp_path / f"{ratio}-{hd}-{scenario}.pt"
    r = hook_env.probe_code(CONSUMER, str(ratio), str(hd), str(rows), "5", scenario, str(out), env={**ENV, **env},
                            timeout=600)
    assert r.rc == 0, r.stderr[-4000:]
    return r.result, torch.load(out, weights_only=False)


def test_import_replaces_both_class_attributes(hook_env):
    r = hook_env.probe_code(IDENTITY, env={})
    assert r.rc == 0, r.stderr
    assert r.result["seen"] == {"core": True, "indexer": True, "unified_is_upstream": True, "upstream_kept": True}
    for spec in SPECS:
        st = r.result["status"][spec.name]
        assert st["active"] is True and st["ours_function"] == OURS, st
        line = [ln for ln in r.hook_lines if spec.title in ln]
        assert len(line) == 1 and "ACTIVE" in line[0] and spec.upstream_function in line[0], r.stderr


def test_switch_off_leaves_upstream(hook_env):
    r = hook_env.probe_code(IDENTITY, env={"V4FLASH_COMPRESSOR": "0"})
    assert r.rc == 0, r.stderr
    assert not r.result["seen"]["core"] and not r.result["seen"]["indexer"]
    for spec in SPECS:
        st = r.result["status"][spec.name]
        assert st["active"] is False and "V4FLASH_COMPRESSOR=0" in st["reason"], st


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ratio,hd", KINDS, ids=["c4", "c128", "indexer"])
def test_decode_step_through_sglangs_objects_is_ours_and_matches_fp64(hook_env, tmp_path, ratio, hd):
    res, out = _consumer(hook_env, tmp_path, ratio, hd, 4, "decode", {})
    assert res["error"] is None and res["entered"] == ["ours", "ours.kernel"], res
    assert all(res["status"].values()), res
    case = R.make_case(4, ratio, hd, 256, 5)
    ref = R.step_ref(case)
    ok, metrics, why = R.check_step(case, ref, out["state"], out["cache"], case["cache"])
    assert ok and metrics["rows_completed"] == 2, (why, metrics)


@pytest.mark.timeout(900)
def test_what_ours_does_not_fuse_reaches_upstreams_forward_unified(hook_env, tmp_path):
    case = R.make_case(4, 4, 512, 256, 5)
    res, out = _consumer(hook_env, tmp_path, 4, 512, 4, "idle", {})
    assert res["entered"] == ["ours", "upstream"] and res["error"] is None, res  # upstream returns at once
    assert torch.equal(out["state"], case["state"]) and torch.equal(out["cache"], case["cache"])
    for scenario in ("prefill", "rows17"):
        res, out = _consumer(hook_env, tmp_path, 4, 512, 4, scenario, {})
        # upstream's own path: its cuBLAS GEMM (compute_kv_score), whose CPU run fails inside upstream
        assert res["entered"][:3] == ["ours", "upstream", "upstream.gemm"] and res["error"], (scenario, res)
        assert "ours.kernel" not in res["entered"] and torch.equal(out["state"], case["state"]), scenario
    res, out = _consumer(hook_env, tmp_path, 4, 128, 4, "decode", {"V4FLASH_COMPRESSOR": "0"})
    assert res["entered"][:2] == ["upstream", "upstream.gemm"] and "ours" not in res["entered"], res
    assert not any(res["status"].values()) and res["error"], res
