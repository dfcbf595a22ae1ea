"""The MoE patch against the real pinned sglang 0.5.13.post1 wheel, each scenario in a fresh interpreter.

The consumer scenario runs SGLang's own sm_120 MoE path, `Mxfp4MarlinMoEMethod.apply` with
`layer._dsv4_mxfp4_backend == "sm120_triton"` (it imports `mxfp4_moe_forward_triton` from the
patched module inside the call, at call time), on CPU under TRITON_INTERPRET=1. Stand-ins only for
what a loaded model would hold: the layer's weight attributes and the runner's config. Patched and
unpatched runs must enter the function they claim and both match the fp64 reference.
"""

from __future__ import annotations

import json

import pytest
import torch
from hookenv import build_hook_env, sglang_overlay

from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.moe.reference import ref_of

TARGET = "sglang.srt.layers.moe.fused_moe_triton.mxfp4_moe_sm120_triton"
UPSTREAM = f"{TARGET}.mxfp4_moe_forward_triton"
OURS = "v4flash_kernels.moe.op.mxfp4_moe_forward"

IDENTITY = """
import importlib, json, os
mod = importlib.import_module("sglang.srt.layers.moe.fused_moe_triton.mxfp4_moe_sm120_triton")
fn = mod.mxfp4_moe_forward_triton
from v4flash_kernels.hook import hook
from v4flash_kernels.moe import op as moe
res = {"pid": os.getpid(), "fn": f"{fn.__module__}.{fn.__qualname__}", "is_ours": fn is moe.mxfp4_moe_forward,
       "status": hook.patch_status("moe")}
if os.environ.get("PROBE_ALSO_ATTENTION"):
    importlib.import_module("sglang.srt.layers.attention.flash_mla_sm120_triton")
    res["attention"] = hook.patch_status("sparse_decode")
print("PROBE-JSON " + json.dumps(res, default=str))
"""

CONSUMER = """
import importlib, json, os, sys
from types import SimpleNamespace

from triton.runtime import autotuner as _a
from v4flash_kernels.interpreter import fix_index  # numpy >= 2.4 vs Triton 3.6's interpreter
fix_index()
# upstream's @triton.autotune benchmarks through a GPU driver the interpreter lacks: equal timings
# make its first config run; the math is unchanged.
_a.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]

import torch
from sglang.srt.layers.moe.topk import StandardTopKOutput
from sglang.srt.layers.quantization.mxfp4_marlin_moe import Mxfp4MarlinMoEMethod
from v4flash_kernels.hook import hook
from v4flash_kernels.moe.reference import MoeCase, make_inputs

seed, out_path = int(sys.argv[1]), sys.argv[2]
kw = make_inputs(MoeCase(tokens=3, experts=8, topk=6, hidden=128, inter=64, hole_frac=0.25,
                         clamp_limit=0.4, routed_scaling_factor=2.5), seed=seed)
P = lambda t: torch.nn.Parameter(t, requires_grad=False)
layer = SimpleNamespace(_dsv4_mxfp4_backend="sm120_triton", w13_weight=P(kw["w13_packed"]),
                        w2_weight=P(kw["w2_packed"]), w13_weight_scale_inv=P(kw["w13_scale"]),
                        w2_weight_scale_inv=P(kw["w2_scale"]))
method = Mxfp4MarlinMoEMethod(fp8_method=None, prefix="model.layers.3.mlp.experts")
method.runner = SimpleNamespace(config=SimpleNamespace(routed_scaling_factor=kw["routed_scaling_factor"],
                                                       swiglu_limit=kw["clamp_limit"]))
dispatch = SimpleNamespace(hidden_states=kw["hidden_states"], topk_output=StandardTopKOutput(
    topk_weights=kw["topk_weights"], topk_ids=kw["topk_ids"], router_logits=torch.zeros(3, 8)))
who = {("v4flash_kernels/moe/op.py", "mxfp4_moe_forward"): "ours",
       ("fused_moe_triton/mxfp4_moe_sm120_triton.py", "mxfp4_moe_forward_triton"): "upstream"}
entered = []
def prof(frame, event, arg):
    if event == "call":
        for (suffix, name), w in who.items():
            if frame.f_code.co_name == name and frame.f_code.co_filename.replace(os.sep, "/").endswith(suffix):
                entered.append(w)
sys.setprofile(prof)
try:
    combine = method.apply(layer, dispatch)
finally:
    sys.setprofile(None)
torch.save({"kw": kw, "out": combine.hidden_states}, out_path)
print("PROBE-JSON " + json.dumps({"entered": entered, "status": hook.patch_status("moe")}, default=str))
"""


def _probe(env, code: str, *args: str, extra_env: dict, timeout: int = 240) -> tuple:
    r = env.probe_code(code, *args, env=extra_env, timeout=timeout)
    return r, r.result, r.hook_lines


def test_import_swaps_the_moe_function(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, extra_env={})
    assert p.rc == 0, p.stderr
    assert res["is_ours"] and res["fn"] == OURS
    assert res["status"]["active"] is True, res["status"]
    lines = [ln for ln in lines if "MoE" in ln]  # the MoE module imports fp8_utils: that patch logs its own line
    assert len(lines) == 1 and "MXFP4 MoE patch ACTIVE" in lines[0] and UPSTREAM in lines[0] and OURS in lines[0]


def test_moe_switch_off_is_independent_of_attention(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, extra_env={"V4FLASH_MOE": "0", "PROBE_ALSO_ATTENTION": "1"})
    assert p.rc == 0, p.stderr
    assert not res["is_ours"] and res["fn"] == UPSTREAM
    assert res["status"]["active"] is False and "V4FLASH_MOE=0" in res["status"]["reason"]
    assert res["attention"]["active"] is True  # the other patch does not follow this switch
    assert not any("WARNING" in ln for ln in lines), lines


@pytest.mark.slow  # both MoE implementations under the Triton interpreter
@pytest.mark.timeout(900)
def test_sglang_sm120_moe_path_on_and_off_agree(hook_env, tmp_path):
    runs = {}
    for mode, extra in (("on", {}), ("off", {"V4FLASH_MOE": "0"})):
        out = tmp_path / f"{mode}.pt"
        p, res, _ = _probe(hook_env, CONSUMER, "5", str(out), extra_env={"TRITON_INTERPRET": "1", **extra},
                           timeout=600)
        assert p.rc == 0, p.stderr[-4000:]
        runs[mode] = (res, torch.load(out, weights_only=False))
    assert runs["on"][0]["entered"] == ["ours"] and runs["on"][0]["status"]["active"] is True
    assert runs["off"][0]["entered"] == ["upstream"] and runs["off"][0]["status"]["active"] is False
    kw = runs["on"][1]["kw"]
    for k, v in runs["off"][1]["kw"].items():  # same seed -> the same inputs in both interpreters
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, kw[k]), k
    ref = ref_of(kw)
    ours, up = runs["on"][1]["out"], runs["off"][1]["out"]
    assert ours.shape == up.shape == kw["hidden_states"].shape and ours.dtype == up.dtype == torch.bfloat16
    assert rel_err(ours, ref) <= 1e-2
    # Upstream rounds through four bf16 buffers and the interpreter's fp32->bf16 cast truncates: ~1 %.
    assert rel_err(up, ref) <= 3e-2
    assert rel_err(ours, up.double()) <= 3e-2


def test_changed_upstream_signature_no_moe_patch_one_warning(tmp_path, hook_wheel, sglang_layer):
    rel = "sglang/srt/layers/moe/fused_moe_triton/mxfp4_moe_sm120_triton.py"
    old = "    clamp_limit: Optional[float] = None,\n) -> torch.Tensor:"
    new = "    clamp_limit: Optional[float] = None,\n    out: Optional[torch.Tensor] = None,\n) -> torch.Tensor:"
    overlay = sglang_overlay(tmp_path / "overlay", sglang_layer, edit=(rel, old, new))
    env = build_hook_env(tmp_path / "venv", hook_wheel, sglang_layer, overlay)
    p, res, lines = _probe(env, IDENTITY, extra_env={"PROBE_ALSO_ATTENTION": "1"})
    assert p.rc == 0, p.stderr
    assert res["fn"] == UPSTREAM and not res["is_ours"]
    assert res["status"]["active"] is False and "signature differs" in res["status"]["reason"]
    assert res["attention"]["active"] is True  # refusing one patch leaves the other in place
    moe_lines = [ln for ln in lines if "MoE" in ln]
    assert len(moe_lines) == 1, p.stderr
    assert "WARNING" in moe_lines[0] and "signature differs" in moe_lines[0] and "out=None" in moe_lines[0]


# ---------------------------------------------------------------- load-time repack + repacked dispatch

MARLIN = "sglang.srt.layers.quantization.mxfp4_marlin_moe"

REPACK_IDENTITY = """
import importlib, json
cls = importlib.import_module("sglang.srt.layers.quantization.mxfp4_marlin_moe").Mxfp4MarlinMoEMethod
from v4flash_kernels.hook import hook
from v4flash_kernels.moe import sglang_patch as sp
res = {"pwal_is_ours": cls.process_weights_after_loading is sp.process_weights_after_loading,
       "apply_is_ours": cls.apply is sp.apply,
       "repack": hook.patch_status("moe_repack"), "apply": hook.patch_status("moe_apply")}
print("PROBE-JSON " + json.dumps(res, default=str))
"""

REPACK_CONSUMER = """
import json, os, sys
from types import SimpleNamespace

from triton.runtime import autotuner as _a
from v4flash_kernels.interpreter import fix_index  # numpy >= 2.4 vs Triton 3.6's interpreter
fix_index()
_a.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]

import torch
import sglang.srt.layers.quantization.mxfp4_marlin_moe as mm
from sglang.srt.layers.moe.topk import StandardTopKOutput
from v4flash_kernels.hook import hook
from v4flash_kernels.moe.reference import MoeCase, make_inputs

seed, scales, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
mm.is_sm120_supported = lambda: True  # SGLang's sm_120 branch on a CPU host: the one thing a stand-in must fake
kw = make_inputs(MoeCase(tokens=3, experts=8, topk=6, hidden=128, inter=64, hole_frac=0.25,
                         clamp_limit=0.4, routed_scaling_factor=2.5), seed=seed)
if scales == "any":  # fp32 scales that are not powers of two: the layer must keep SGLang's path
    kw["w2_scale"] = kw["w2_scale"] * 1.25
method = mm.Mxfp4MarlinMoEMethod(fp8_method=SimpleNamespace(process_weights_after_loading=lambda layer: None),
                                 prefix="model.layers.3.mlp.experts")
layer = torch.nn.Module()
method.create_weights(layer, num_experts=8, hidden_size=128, intermediate_size_per_partition=64,
                      params_dtype=torch.bfloat16)
with torch.no_grad():  # what the checkpoint loader writes into the Parameters create_weights made
    for p, k in (("w13_weight", "w13_packed"), ("w2_weight", "w2_packed"), ("w13_weight_scale_inv", "w13_scale"),
                 ("w2_weight_scale_inv", "w2_scale")):
        getattr(layer, p).copy_(kw[k])
method.process_weights_after_loading(layer)
method.runner = SimpleNamespace(config=SimpleNamespace(routed_scaling_factor=kw["routed_scaling_factor"],
                                                       swiglu_limit=kw["clamp_limit"]))
dispatch = SimpleNamespace(hidden_states=kw["hidden_states"], topk_output=StandardTopKOutput(
    topk_weights=kw["topk_weights"], topk_ids=kw["topk_ids"], router_logits=torch.zeros(3, 8)))
who = {("v4flash_kernels/moe/repacked_op.py", "run_repacked"): "v2",
       ("v4flash_kernels/moe/op.py", "mxfp4_moe_forward"): "v1",
       ("fused_moe_triton/mxfp4_moe_sm120_triton.py", "mxfp4_moe_forward_triton"): "upstream"}
entered = []
def prof(frame, event, arg):
    if event == "call":
        for (suffix, name), w in who.items():
            if frame.f_code.co_name == name and frame.f_code.co_filename.replace(os.sep, "/").endswith(suffix):
                entered.append(w)
sys.setprofile(prof)
try:
    combine = method.apply(layer, dispatch)
finally:
    sys.setprofile(None)
torch.save({"kw": kw, "out": combine.hidden_states}, out_path)
print("PROBE-JSON " + json.dumps({
    "entered": entered, "repacked": getattr(layer, "_v4flash_moe", None) is not None,
    "scale_dtypes": [str(layer.w13_weight_scale_inv.dtype), str(layer.w2_weight_scale_inv.dtype)],
    "repack_status": hook.patch_status("moe_repack")}, default=str))
"""


def test_import_swaps_the_repack_and_dispatch_methods(hook_env):
    p, res, lines = _probe(hook_env, REPACK_IDENTITY, extra_env={})
    assert p.rc == 0, p.stderr
    assert res["pwal_is_ours"] and res["apply_is_ours"]
    assert res["repack"]["active"] is True and res["apply"]["active"] is True, res
    assert res["repack"]["switch_name"] == "moe" == res["apply"]["switch_name"]
    assert "no sm_120 MoE layer loaded yet" in res["repack"]["reason"]
    assert sum("ACTIVE" in ln and "MXFP4 MoE" in ln for ln in lines) == 2, lines  # other modules' patches may log too


def test_moe_switch_off_leaves_the_layer_methods_alone(hook_env):
    p, res, lines = _probe(hook_env, REPACK_IDENTITY, extra_env={"V4FLASH_MOE": "0"})
    assert p.rc == 0, p.stderr
    assert not res["pwal_is_ours"] and not res["apply_is_ours"]
    assert res["repack"]["active"] is False and "V4FLASH_MOE=0" in res["repack"]["reason"]
    assert res["apply"]["active"] is False
    assert not any("WARNING" in ln for ln in lines), lines


@pytest.mark.slow  # v2, v1 and upstream under the Triton interpreter
@pytest.mark.timeout(1200)
def test_sglang_sm120_layer_repacked_v2_and_fallback_agree(hook_env, tmp_path):
    """SGLang's own create_weights -> (loader writes) -> process_weights_after_loading -> apply, on CPU.

    Power-of-two scales: the layer is repacked (e8m0 scale Parameters) and apply runs v2. Scales that
    are not powers of two: the layer is not repacked, one warning names it, the status records it,
    and apply runs SGLang's path (our v1 drop-in through the moe patch). Switch off: upstream only.
    All three match the fp64 reference.
    """
    runs = {}
    for mode, scales, extra in (("v2", "pow2", {}), ("kept", "any", {}), ("off", "pow2", {"V4FLASH_MOE": "0"})):
        out = tmp_path / f"{mode}.pt"
        st_dir = tmp_path / f"status-{mode}"
        p, res, lines = _probe(hook_env, REPACK_CONSUMER, "5", scales, str(out), timeout=900,
                               extra_env={"TRITON_INTERPRET": "1", "V4FLASH_PATCH_STATUS_DIR": str(st_dir), **extra})
        assert p.rc == 0, p.stderr[-4000:]
        runs[mode] = (res, torch.load(out, weights_only=False), lines, st_dir)
    res, data, lines, _ = runs["v2"]
    assert res["entered"] == ["v2"] and res["repacked"]
    assert res["scale_dtypes"] == ["torch.float8_e8m0fnu"] * 2
    assert res["repack_status"]["detail"]["repacked_layers"] == 1
    assert "repacked 1 of 1" in res["repack_status"]["reason"]
    assert rel_err(data["out"], ref_of(data["kw"])) <= 1e-2

    res, data, lines, st_dir = runs["kept"]
    assert res["entered"] == ["v1"] and not res["repacked"]
    assert res["scale_dtypes"] == ["torch.float32"] * 2
    warn = [ln for ln in lines if "not repacked" in ln]
    assert len(warn) == 1 and "model.layers.3.mlp.experts" in warn[0] and "w2_weight_scale_inv" in warn[0], lines
    kept = res["repack_status"]["detail"]["kept_layers"]
    assert list(kept) == ["model.layers.3.mlp.experts"] and "not exact powers of two" in kept["model.layers.3.mlp.experts"]
    (status_file,) = st_dir.glob("patch-*.json")
    on_disk = json.loads(status_file.read_text())["patches"]["moe_repack"]
    assert "1 kept SGLang's path" in on_disk["reason"] and on_disk["detail"]["repacked_layers"] == 0
    assert rel_err(data["out"], ref_of(data["kw"])) <= 1e-2

    res, data, lines, _ = runs["off"]
    assert res["entered"] == ["upstream"] and not res["repacked"]
    assert res["scale_dtypes"] == ["torch.float32"] * 2
    assert rel_err(data["out"], ref_of(data["kw"])) <= 3e-2  # upstream's own bf16 round trips


@pytest.mark.slow  # a second venv over an edited sglang, and v1 under the Triton interpreter
@pytest.mark.timeout(1200)
def test_refused_dispatch_patch_means_no_repack(tmp_path, hook_wheel, sglang_layer):
    """Only moe_apply reads the repacked order: when it is refused (upstream's apply changed), the
    repack leaves every layer as loaded and says why, and SGLang's own path stays correct."""
    rel = "sglang/srt/layers/quantization/mxfp4_marlin_moe.py"
    old = "        dispatch_output: DispatchOutput,\n    ) -> CombineInput:"
    new = "        dispatch_output: DispatchOutput,\n        extra=None,\n    ) -> CombineInput:"
    overlay = sglang_overlay(tmp_path / "overlay", sglang_layer, edit=(rel, old, new))
    env = build_hook_env(tmp_path / "venv", hook_wheel, sglang_layer, overlay)
    out = tmp_path / "out.pt"
    p, res, lines = _probe(env, REPACK_CONSUMER, "5", "pow2", str(out), timeout=900,
                           extra_env={"TRITON_INTERPRET": "1"})
    assert p.rc == 0, p.stderr[-4000:]
    assert any("WARNING" in ln and "repacked-layer dispatch" in ln and "signature differs" in ln for ln in lines), lines
    assert res["entered"] == ["v1"] and not res["repacked"]
    assert res["scale_dtypes"] == ["torch.float32"] * 2
    assert "moe_apply patch is not active" in res["repack_status"]["reason"]
    data = torch.load(out, weights_only=False)
    assert rel_err(data["out"], ref_of(data["kw"])) <= 1e-2
