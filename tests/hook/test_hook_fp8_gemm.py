"""The block-FP8 linear patch against the real pinned sglang 0.5.13.post1 wheel, each scenario in a fresh interpreter.

The consumer scenario runs SGLang's own layer: a `ReplicatedLinear` with an `Fp8Config` of 128x128
weight blocks (how DeepSeek-V4's wqkv_a / wq_b / wo_b / shared-expert linears are built), whose
`Fp8LinearMethod` took its kernel from `dispatch_w8a8_block_fp8_linear()` with the FP8 GEMM backend
SGLang sets on sm_120 (`initialize_fp8_gemm_config`: "auto" -> "triton"), and calls its forward on
CPU under TRITON_INTERPRET=1. Stand-ins only for the hardware probe `is_sm120_supported` (forced True:
this box has no sm_120), the TP world size (no process group here) and the GPU name upstream's
GEMM looks its tuned configs up by (the RTX PRO 6000's: the wheel has none, the default config). Patched and unpatched runs
must enter the function they claim and match the fp64 reference.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.fp8_gemm.reference import linear_ref
from v4flash_kernels.kit.compare import excess_error, rel_err

TARGET = "sglang.srt.layers.quantization.fp8_utils"
UPSTREAM = f"{TARGET}.triton_w8a8_block_fp8_linear"
OURS = "v4flash_kernels.fp8_gemm.op.w8a8_block_fp8_linear"

IDENTITY = """
import importlib, json, os
from types import SimpleNamespace
mod = importlib.import_module("sglang.srt.layers.quantization.fp8_utils")
mod.is_sm120_supported = lambda: True
mod.initialize_fp8_gemm_config(SimpleNamespace(fp8_gemm_runner_backend="auto"))
fn = mod.triton_w8a8_block_fp8_linear
dispatched = mod.dispatch_w8a8_block_fp8_linear()
from v4flash_kernels.hook import hook
from v4flash_kernels.fp8_gemm import op
print("PROBE-JSON " + json.dumps({
    "pid": os.getpid(), "fn": f"{fn.__module__}.{fn.__qualname__}", "is_ours": fn is op.w8a8_block_fp8_linear,
    "dispatched_ours": dispatched is op.w8a8_block_fp8_linear, "backend": str(mod.get_fp8_gemm_runner_backend()),
    "status": hook.patch_status("fp8_gemm"),
}, default=str))
"""

CONSUMER = """
import json, os, sys
from types import SimpleNamespace

from v4flash_kernels.interpreter import fix_index  # numpy >= 2.4 vs Triton 3.6's interpreter
fix_index()

import torch
from sglang.srt.layers.quantization import fp8, fp8_kernel, fp8_utils
from sglang.srt.layers.linear import ReplicatedLinear
from v4flash_kernels.hook import hook
from v4flash_kernels.fp8_gemm.reference import make_activation, make_weight

fp8_utils.is_sm120_supported = lambda: True  # the sm_120 branch of initialize_fp8_gemm_config on this CPU box
fp8_utils.initialize_fp8_gemm_config(SimpleNamespace(fp8_gemm_runner_backend="auto"))
fp8.get_tensor_model_parallel_world_size = lambda: 1  # no TP process group here
# upstream's GEMM looks for a tuned config by GPU name (None on CPU): the sm_120 card's, which has none
fp8_kernel.get_device_name = lambda: "NVIDIA RTX PRO 6000 Blackwell Server Edition"
seed, out_path = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(seed)
N, K = 384, 256
cfg = fp8.Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
lin = ReplicatedLinear(K, N, bias=False, quant_config=cfg, prefix="model.layers.0.self_attn.wqkv_a",
                       params_dtype=torch.bfloat16)
w, ws = make_weight(N, K, g)
lin.weight.data.copy_(w)
lin.weight_scale_inv.data.copy_(ws)
lin.quant_method.process_weights_after_loading(lin)
xs = [make_activation(3, K, g), make_activation(17, K, g).view(1, 17, K)]
who = {("v4flash_kernels/fp8_gemm/op.py", "w8a8_block_fp8_linear"): "ours",
       ("quantization/fp8_utils.py", "triton_w8a8_block_fp8_linear"): "upstream"}
entered = []
def prof(frame, event, arg):
    if event == "call":
        for (suffix, name), w_ in who.items():
            if frame.f_code.co_name == name and frame.f_code.co_filename.replace(os.sep, "/").endswith(suffix):
                entered.append(w_)
outs = []
sys.setprofile(prof)
try:
    for x in xs:
        outs.append(lin(x)[0])
finally:
    sys.setprofile(None)
k = lin.quant_method.w8a8_block_fp8_linear
torch.save({"w": w, "ws": ws, "xs": xs, "outs": outs}, out_path)
print("PROBE-JSON " + json.dumps({"entered": entered, "kernel": f"{k.__module__}.{k.__qualname__}",
                                  "backend": str(fp8_utils.get_fp8_gemm_runner_backend()),
                                  "status": hook.patch_status("fp8_gemm")}, default=str))
"""


def _probe(hook_env, code: str, *args: str, env: dict, timeout: int = 240) -> tuple:
    r = hook_env.probe_code(code, *args, env=env, timeout=timeout)
    return r, r.result, r.hook_lines


def test_import_swaps_the_linear_the_sm120_dispatch_returns(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={})
    assert p.rc == 0, p.stderr
    assert res["is_ours"] and res["dispatched_ours"] and res["fn"] == OURS, res
    assert res["backend"] == "Fp8GemmRunnerBackend.TRITON"
    assert res["status"]["active"] is True, res["status"]
    line = [ln for ln in lines if "FP8" in ln]
    assert len(line) == 1 and "ACTIVE" in line[0] and UPSTREAM in line[0] and OURS in line[0], p.stderr


def test_switch_off_leaves_upstream(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={"V4FLASH_FP8_GEMM": "0"})
    assert p.rc == 0, p.stderr
    assert not res["is_ours"] and not res["dispatched_ours"] and res["fn"] == UPSTREAM
    st = res["status"]
    assert st["active"] is False and "V4FLASH_FP8_GEMM=0" in st["reason"]
    assert not any("WARNING" in ln for ln in lines if "FP8" in ln), lines


@pytest.mark.timeout(900)
def test_sglang_fp8_linear_forward_on_and_off_match_the_reference(hook_env, tmp_path):
    runs = {}
    for mode, extra in (("on", {}), ("off", {"V4FLASH_FP8_GEMM": "0"})):
        out = tmp_path / f"{mode}.pt"
        p, res, _ = _probe(hook_env, CONSUMER, "7", str(out), env={"TRITON_INTERPRET": "1", **extra}, timeout=600)
        assert p.rc == 0, p.stderr[-4000:]
        runs[mode] = (res, torch.load(out, weights_only=False))
    on, off = runs["on"], runs["off"]
    assert on[0]["entered"] == ["ours", "ours"] and on[0]["kernel"] == OURS and on[0]["status"]["active"] is True
    assert off[0]["entered"] == ["upstream", "upstream"] and off[0]["kernel"] == UPSTREAM
    assert off[0]["status"]["active"] is False
    assert on[0]["backend"] == off[0]["backend"] == "Fp8GemmRunnerBackend.TRITON"
    d_on, d_off = on[1], off[1]
    for a, b in zip(d_on["xs"], d_off["xs"]):  # same seed -> the same inputs in both interpreters
        assert torch.equal(a, b)
    for x, o_on, o_off in zip(d_on["xs"], d_on["outs"], d_off["outs"]):
        assert o_on.shape == o_off.shape == (*x.shape[:-1], 384) and o_on.dtype == o_off.dtype == torch.bfloat16
        ref, mag = linear_ref(x.reshape(-1, x.shape[-1]), d_on["w"], d_on["ws"])
        # ours: the definition's quant exactly, bf16 output (the interpreter's cast truncates: < 1 ulp)
        assert excess_error(o_on.reshape(ref.shape), ref, mag, 2.0 ** -7, 2.0 ** -16) <= 1.0
        # upstream on CPU quantizes with its Triton kernel, whose fp32 -> e4m3 cast the interpreter
        # gets wrong near binade edges (127.7 -> 64): only close, not exact, off the GPU
        assert rel_err(o_off.reshape(ref.shape), ref) <= 5e-2
