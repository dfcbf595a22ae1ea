"""The q norm + RoPE fusion patch against the real pinned sglang 0.5.13.post1 wheel, each scenario in a fresh interpreter.

The consumer scenario calls SGLang's own `MQALayer._compute_q_b` (the class attribute the patch
replaces) on an `MQALayer` whose wq_b is SGLang's own `ColumnParallelLinear` with an `Fp8Config` of
128x128 blocks, built as `MQALayer.__init__` builds it at attention-TP 2 (rank 1: heads 2-3 of 4), its
`Fp8LinearMethod` holding the kernel `dispatch_w8a8_block_fp8_linear()` gave it under the FP8 backend
SGLang sets on sm_120; `q_out` is the padded q's slice, as `MQALayer.forward` passes it. On CPU under
TRITON_INTERPRET=1. Stand-ins: the MQALayer's other sub-layers are not built (only the attributes the
method reads are set: `__init__` needs the whole attention stack), the hardware probe
`is_sm120_supported` (True), the TP world size (1: no process group) and the GPU name upstream's GEMM
looks its configs up by, as in test_hook_fp8_gemm; and `fused_q_norm_rope`, a JIT CUDA kernel that
cannot run on a CPU, by its torch statement (`qnorm_rope.upstream.q_norm_rope`) under the name the
model module calls.
With both switches on, a decode call (3 rows) enters ours and the fused kernel only, and a 17-row call
ours, then upstream's method over our block-FP8 linear; with the switch off, upstream's method runs;
with the fp8_gemm switch off, ours hands every call to upstream's method (wq_b's GEMM is upstream's) and
says so once. Every result is checked against the fp64 reference.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

from v4flash_kernels.hook import patches
from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.qnorm_rope import reference as R

DSV4 = "sglang.srt.models.deepseek_v4"
UPSTREAM = f"{DSV4}.MQALayer._compute_q_b"
OURS = "v4flash_kernels.qnorm_rope.op.compute_q_b"

IDENTITY = """
import importlib, json
mod = importlib.import_module("sglang.srt.models.deepseek_v4")
from v4flash_kernels.hook import hook, patches
from v4flash_kernels.qnorm_rope import op
fn = mod.MQALayer._compute_q_b
kept = getattr(mod, hook.upstream_keep_attr(patches.QNORM_ROPE), None)
print("PROBE-JSON " + json.dumps({
    "fn": f"{fn.__module__}.{fn.__qualname__}", "is_ours": fn is op.compute_q_b,
    "kept": f"{kept.__module__}.{kept.__qualname__}" if kept else None,
    "status": hook.patch_status("qnorm_rope"),
}, default=str))
"""

CONSUMER = """
import importlib, json, os, sys
from types import SimpleNamespace

from v4flash_kernels.interpreter import fix_index  # numpy >= 2.4 vs Triton 3.6's interpreter
fix_index()

import torch
from torch import nn
dsv4 = importlib.import_module("sglang.srt.models.deepseek_v4")
from sglang.srt.layers.linear import ColumnParallelLinear
from sglang.srt.layers.quantization import fp8, fp8_kernel, fp8_utils
from v4flash_kernels.hook import hook
from v4flash_kernels.qnorm_rope import reference as R
from v4flash_kernels.qnorm_rope.upstream import q_norm_rope

fp8_utils.is_sm120_supported = lambda: True  # the sm_120 branch of initialize_fp8_gemm_config on this CPU box
fp8_utils.initialize_fp8_gemm_config(SimpleNamespace(fp8_gemm_runner_backend="auto"))
fp8.get_tensor_model_parallel_world_size = lambda: 1  # no TP process group here
fp8_kernel.get_device_name = lambda: "NVIDIA RTX PRO 6000 Blackwell Server Edition"
dsv4.fused_q_norm_rope = q_norm_rope  # the JIT CUDA kernel's torch statement (no CUDA JIT on a CPU)

seed, out_path = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(seed)
HEADS, TP, RANK, K = 4, 2, 1, 1024
local = HEADS // TP
cfg = fp8.Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
# as MQALayer.__init__ builds wq_b
wq_b = ColumnParallelLinear(K, HEADS * 512, bias=False, quant_config=cfg, prefix="model.layers.0.self_attn.wq_b",
                            tp_rank=RANK, tp_size=TP, params_dtype=torch.bfloat16)
w, ws = R.make_weight(local * 512, K, g)
wq_b.weight.data.copy_(w)
wq_b.weight_scale_inv.data.copy_(ws)
wq_b.quant_method.process_weights_after_loading(wq_b)
layer = dsv4.MQALayer.__new__(dsv4.MQALayer)
nn.Module.__init__(layer)
layer.wq_b = wq_b
layer.n_local_heads, layer.head_dim, layer.qk_rope_head_dim, layer.eps = local, 512, 64, 1e-6
layer.register_buffer("freqs_cis", R.make_freqs_cis(4096), persistent=False)

who = {("v4flash_kernels/qnorm_rope/op.py", "compute_q_b"): "ours",
       ("v4flash_kernels/qnorm_rope/op.py", "qnorm_rope"): "fused",
       ("models/deepseek_v4.py", "_compute_q_b"): "upstream",
       ("v4flash_kernels/fp8_gemm/op.py", "w8a8_block_fp8_linear"): "our_linear",
       ("quantization/fp8_utils.py", "triton_w8a8_block_fp8_linear"): "upstream_linear",
       ("v4flash_kernels/qnorm_rope/upstream.py", "q_norm_rope"): "norm_rope"}
runs = []
for rows in (3, 17):
    x = R.make_activation(rows, K, g)
    pos = R.make_positions(rows, 4096, g)
    padded = torch.full((rows, HEADS, 512), float("nan"), dtype=torch.bfloat16)
    q_out = padded[:, RANK * local:(RANK + 1) * local]  # as MQALayer.forward slices it at TP > 1
    entered = []
    def prof(frame, event, arg):
        if event == "call":
            fname = frame.f_code.co_filename.replace(os.sep, "/")
            for (suffix, name), w_ in who.items():
                if frame.f_code.co_name == name and fname.endswith(suffix):
                    entered.append(w_)
    sys.setprofile(prof)
    try:
        got = layer._compute_q_b(x, pos, q_out)
    finally:
        sys.setprofile(None)
    runs.append({"x": x, "pos": pos, "padded": padded, "same_q_out": got is q_out, "entered": entered})
torch.save({"w": w, "ws": ws, "freqs": layer.freqs_cis, "runs": runs}, out_path)
k = wq_b.quant_method.w8a8_block_fp8_linear
print("PROBE-JSON " + json.dumps({"entered": [r["entered"] for r in runs], "same_q_out": [r["same_q_out"] for r in runs],
                                  "linear": f"{k.__module__}.{k.__qualname__}",
                                  "status": hook.patch_status("qnorm_rope")}, default=str))
"""


def _probe(hook_env, code: str, *args: str, env: dict, timeout: int = 300):
    r = hook_env.probe_code(code, *args, env=env, timeout=timeout)
    return r, r.result, r.hook_lines


def test_registry_names_the_method_that_encloses_wq_b_and_the_norm():
    spec = patches.by_name("qnorm_rope")
    assert (spec.target_module, spec.target_attr, spec.switch_env) == (DSV4, "MQALayer._compute_q_b",
                                                                       "V4FLASH_QNORM_ROPE")
    assert patches.switch_by_name("qnorm_rope").selfcheck == "v4flash_kernels.qnorm_rope.selfcheck"


def test_unset_is_off_by_default(hook_env):
    """The switch is off by default (it measured slower than what it replaces): a worker whose variable
    is unset keeps upstream's method and says why."""
    assert patches.switch_by_name("qnorm_rope").default_on is False
    p, res, lines = _probe(hook_env, IDENTITY, env={})
    assert p.rc == 0, p.stderr[-4000:]
    assert not res["is_ours"] and res["fn"] == UPSTREAM, res
    assert res["status"]["active"] is False and "off by default" in res["status"]["reason"], res["status"]


def test_import_swaps_the_method_and_keeps_upstreams(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={"V4FLASH_QNORM_ROPE": "1"})
    assert p.rc == 0, p.stderr[-4000:]
    assert res["is_ours"] and res["fn"] == OURS, res
    assert res["kept"] == UPSTREAM  # upstream's method, reachable for the calls ours does not compute
    assert res["status"]["active"] is True and "fused call(s) seen" in res["status"]["reason"], res["status"]
    line = [ln for ln in lines if "q norm + RoPE" in ln]
    assert len(line) == 1 and "ACTIVE" in line[0] and UPSTREAM in line[0] and OURS in line[0], p.stderr


def test_switch_off_leaves_upstreams_method(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={"V4FLASH_QNORM_ROPE": "0"})
    assert p.rc == 0, p.stderr[-4000:]
    assert not res["is_ours"] and res["fn"] == UPSTREAM and res["kept"] is None
    assert res["status"]["active"] is False and "V4FLASH_QNORM_ROPE=0" in res["status"]["reason"]
    assert not any("WARNING" in ln for ln in lines if "q norm" in ln), lines


def test_only_fp8linearmethod_carries_the_block_linear_in_the_pinned_wheel(sglang_layer):
    """`op.linear_operands` trusts that a quant method holding our `w8a8_block_fp8_linear` is SGLang's
    `Fp8LinearMethod` (whose apply takes the block branch): in the pinned wheel the only other class that
    holds one is a compressed-tensors *scheme*, never a layer's `quant_method`, and nothing subclasses
    Fp8LinearMethod."""
    root = Path(sglang_layer) / "sglang" / "srt"
    holders, subclasses = set(), set()
    for f in root.rglob("*.py"):
        with warnings.catch_warnings():  # upstream's own invalid escapes are not this test's concern
            warnings.simplefilter("ignore")
            tree = ast.parse(f.read_bytes())  # bytes: some files start with a BOM
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in cls.bases}
            if "Fp8LinearMethod" in bases:
                subclasses.add(cls.name)
            for node in ast.walk(cls):
                if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "w8a8_block_fp8_linear"
                                                         for t in node.targets)):
                    holders.add((f.relative_to(root).as_posix(), cls.name, tuple(sorted(bases))))
    assert not subclasses
    assert holders == {
        ("layers/quantization/fp8.py", "Fp8LinearMethod", ("LinearMethodBase",)),
        ("layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py", "CompressedTensorsW8A8Fp8",
         ("CompressedTensorsLinearScheme",)),
    }, holders


def _check(run, d, acc):
    x, pos = run["x"], run["pos"]
    args = (x, d["w"], d["ws"], 2, 1e-6, d["freqs"], pos)
    ref, bound = R.qnorm_rope_ref(*args), R.error_bound(*args, bf16_unit=R.BF16_TRUNC, acc=acc)
    got = run["padded"][:, 2:4]
    others = torch.cat([run["padded"][:, :2], run["padded"][:, 4:]], 1)
    assert torch.isnan(others.float()).all()  # only this rank's heads were written
    return R.excess(got, ref, bound), rel_err(got, ref)


@pytest.mark.timeout(1200)
def test_compute_q_b_on_and_off_through_sglangs_layer(hook_env, tmp_path):
    runs = {}
    on_ = {"V4FLASH_QNORM_ROPE": "1"}
    for mode, extra in (("on", on_), ("off", {"V4FLASH_QNORM_ROPE": "0"}), ("fp8_off", {"V4FLASH_FP8_GEMM": "0", **on_})):
        out = tmp_path / f"{mode}.pt"
        p, res, lines = _probe(hook_env, CONSUMER, "9", str(out), env={"TRITON_INTERPRET": "1", **extra}, timeout=1000)
        assert p.rc == 0, p.stderr[-4000:]
        runs[mode] = (res, torch.load(out, weights_only=False), lines)
    on, off, fp8_off = (runs[m][0] for m in ("on", "off", "fp8_off"))
    assert on["entered"] == [["ours", "fused"], ["ours", "upstream", "our_linear", "norm_rope"]], on["entered"]
    assert on["status"]["active"] is True and "1 fused call(s) seen" in on["status"]["reason"]
    assert off["entered"] == [["upstream", "our_linear", "norm_rope"]] * 2, off["entered"]
    assert off["status"]["active"] is False
    assert fp8_off["entered"] == [["ours", "upstream", "upstream_linear", "norm_rope"]] * 2, fp8_off["entered"]
    assert fp8_off["linear"].endswith("fp8_utils.triton_w8a8_block_fp8_linear")
    said = [ln for ln in runs["fp8_off"][2] if "fusion not used" in ln]
    assert len(said) == 1 and "not v4flash's" in said[0], runs["fp8_off"][2]
    for mode in ("on", "off", "fp8_off"):
        assert runs[mode][0]["same_q_out"] == [True, True]
    d_on, d_off, d_fp8 = (runs[m][1] for m in ("on", "off", "fp8_off"))
    for a, b in zip(d_on["runs"], d_off["runs"]):  # same seed -> the same inputs in every interpreter
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["pos"], b["pos"])
    # ours (fused, and our linear under upstream's method) in IEEE fp32 with truncated bf16 casts
    for d in (d_on, d_off):
        for run in d["runs"]:
            ex, _ = _check(run, d, R.ACC_IEEE)
            assert ex <= 1.0, ex
    # upstream's Triton linear quantizes with a cast the interpreter gets wrong near binade edges
    # (see test_hook_fp8_gemm): only close to the reference off the GPU
    for run in d_fp8["runs"]:
        _, err = _check(run, d_fp8, R.ACC_IEEE)
        assert err <= 5e-2, err
