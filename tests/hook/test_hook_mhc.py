"""The mHC patch against the real pinned sglang 0.5.13.post1 wheel, each scenario in a fresh interpreter.

`sglang.srt.models.deepseek_v4` imports TileLang's `sglang.srt.layers.mhc` at its top; this CPU box
has no `tilelang`: the hook envs' stubs layer (tests/hook/stubs/tilelang) makes it importable, and
every TileLang kernel raises if launched (nothing here may silently run a fake kernel).

The consumer scenario runs the model's own forward, `DeepseekV4Model.forward` over two real
`DeepseekV4DecoderLayer`s built by their own `__init__`, on CPU under TRITON_INTERPRET=1, with
stand-ins only for what a loaded model holds: the attention and MoE sub-layers (fixed random
projections), the parallel-state queries (one rank, no context parallelism), the embedding and
head weights. With the switch on, the layers (whose construction asks the patched
`_is_fused_mhc_post_pre_enabled`) take the fused path: ours for the first pre, the three fused
boundaries and the last post. With it off, upstream's sm_120 path runs (torch `hc_pre` with the
reference split standing in for the TileLang Sinkhorn, torch `hc_post`): every boundary unfused.
Both must enter only the functions they claim and give the same hidden states.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.hook import patches
from v4flash_kernels.mhc import reference as R

DSV4 = "sglang.srt.models.deepseek_v4"
SPECS = patches.patches_of("mhc")

IDENTITY = """
import importlib, json, sys
mod = importlib.import_module("sglang.srt.models.deepseek_v4")
from v4flash_kernels.hook import hook, patches
from v4flash_kernels.mhc import op
seen = {
    "hc_pre": mod.DeepseekV4DecoderLayer.hc_pre is op.hc_pre,
    "hc_post": mod.DeepseekV4DecoderLayer.hc_post is op.hc_post,
    "fused": mod.mhc_fused_post_pre is op.mhc_fused_post_pre,
    "fused_in_mhc_module": sys.modules["sglang.srt.layers.mhc"].mhc_fused_post_pre is op.mhc_fused_post_pre,
    "enabled": mod._is_fused_mhc_post_pre_enabled is op.fused_post_pre_enabled,
    "enabled_says": bool(mod._is_fused_mhc_post_pre_enabled()),
}
st = {p.name: hook.patch_status(p.name) for p in patches.patches_of("mhc")}
print("PROBE-JSON " + json.dumps({"seen": seen, "status": st}, default=str))
"""

CONSUMER = """
import importlib, json, os, sys
from types import SimpleNamespace

from v4flash_kernels.interpreter import fix_index  # numpy >= 2.4 vs Triton 3.6's interpreter
fix_index()

import torch
from torch import nn
dsv4 = importlib.import_module("sglang.srt.models.deepseek_v4")
dsv2 = importlib.import_module("sglang.srt.models.deepseek_v2")
mhc = importlib.import_module("sglang.srt.layers.mhc")
from sglang.srt.layers.layernorm import RMSNorm
from v4flash_kernels.hook import hook, patches
from v4flash_kernels.mhc.upstream import sinkhorn_standin

H, N = int(sys.argv[1]), int(sys.argv[2])
out_path = sys.argv[3]


class Projection(nn.Module):
    # Stand-in for MQALayer / DeepseekV2MoE: a fixed random projection (tanh for the MoE), bf16 out.
    def __init__(self, config, layer_id, seed=0, act=False, **kwargs):
        super().__init__()
        g = torch.Generator().manual_seed(seed + layer_id)
        self.w = (torch.randn(config.hidden_size, config.hidden_size, generator=g)
                  / config.hidden_size ** 0.5).bfloat16()
        self.act = act

    def forward(self, x, *args, **kwargs):
        y = x.float() @ self.w.float()
        return (torch.tanh(y) if self.act else y).bfloat16()


dsv4.MQALayer = lambda config, layer_id, **kw: Projection(config, layer_id, seed=100)
dsv2.DeepseekV2MoE = lambda config, layer_id, **kw: Projection(config, layer_id, seed=200, act=True)
# One rank, no data/context parallelism: what the parallel state answers on a single-GPU server.
dsv4.is_dsa_enable_prefill_cp = lambda: False
dsv4.get_attention_dp_size = lambda: 1
dsv4.get_attention_tp_size = lambda: 1
dsv4.dsa_use_prefill_cp = lambda forward_batch, *a: False
dsv4.get_global_server_args = lambda: SimpleNamespace(disable_piecewise_cuda_graph=False)
# Upstream's Sinkhorn is a TileLang kernel: on CPU the fp64 reference split stands in for it.
mhc.hc_split_sinkhorn = sinkhorn_standin

cfg = SimpleNamespace(hidden_size=H, rms_norm_eps=1e-6, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6)
g = torch.Generator().manual_seed(1)
layers = nn.ModuleList([dsv4.DeepseekV4DecoderLayer(cfg, i) for i in range(2)])
with torch.no_grad():
    for layer in layers:
        for name in ("hc_attn_fn", "hc_ffn_fn"):
            getattr(layer, name).copy_(torch.randn(24, 4 * H, generator=g) * (2.0 / (4 * H) ** 0.5))
        for name in ("hc_attn_base", "hc_ffn_base"):
            getattr(layer, name).copy_(torch.randn(24, generator=g))
        for name in ("hc_attn_scale", "hc_ffn_scale"):
            getattr(layer, name).copy_(torch.rand(3, generator=g) + 0.5)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):  # bf16, as a loaded model's
            norm.weight.data = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
        layer.refresh_mhc_norm_weight_cache()  # what post_load_weights does

model = dsv4.DeepseekV4Model.__new__(dsv4.DeepseekV4Model)
nn.Module.__init__(model)
model.pp_group = SimpleNamespace(is_first_rank=True, is_last_rank=True)
model.embed_tokens = nn.Embedding(64, H).bfloat16()
with torch.no_grad():
    model.embed_tokens.weight.copy_(torch.randn(64, H, generator=g))
model.hidden_size, model.hc_mult, model.start_layer, model.end_layer, model.layers = H, 4, 0, 2, layers
model.norm = RMSNorm(H, eps=1e-6)
model.norm.weight.data = model.norm.weight.data.bfloat16()
model.norm_eps = model.hc_eps = model.rms_norm_eps = 1e-6
model.hc_head_fn = nn.Parameter(torch.randn(4, 4 * H, generator=g) * 0.05)
model.hc_head_base = nn.Parameter(torch.randn(4, generator=g))
model.hc_head_scale = nn.Parameter(torch.ones(1))
model.dsa_enable_prefill_cp = False
model.use_fused_mhc_post_pre = dsv4._is_fused_mhc_post_pre_enabled()  # as DeepseekV4Model.__init__ sets it

who = {("v4flash_kernels/mhc/op.py", "hc_pre"): "ours.hc_pre",
       ("v4flash_kernels/mhc/op.py", "hc_post"): "ours.hc_post",
       ("v4flash_kernels/mhc/op.py", "mhc_fused_post_pre"): "ours.fused",
       ("models/deepseek_v4.py", "hc_pre"): "upstream.hc_pre",
       ("models/deepseek_v4.py", "hc_post"): "upstream.hc_post",
       ("layers/mhc.py", "mhc_fused_post_pre"): "upstream.fused",
       ("layers/mhc.py", "mhc_post"): "upstream.tilelang_post",
       ("v4flash_kernels/mhc/upstream.py", "sinkhorn_standin"): "upstream.sinkhorn"}
entered = []
def prof(frame, event, arg):
    if event == "call":
        fname = frame.f_code.co_filename.replace(os.sep, "/")
        for (suffix, name), w in who.items():
            if frame.f_code.co_name == name and fname.endswith(suffix):
                entered.append(w)
ids = torch.randint(0, 64, (N,), generator=g)
sys.setprofile(prof)
try:
    with torch.no_grad():
        hidden, pre_head = model.forward(ids, torch.arange(N), SimpleNamespace(), None)
finally:
    sys.setprofile(None)
torch.save({"hidden": hidden, "pre_head": pre_head}, out_path)
print("PROBE-JSON " + json.dumps({
    "entered": entered, "use_fused": [bool(x.use_fused_mhc_post_pre) for x in layers] + [model.use_fused_mhc_post_pre],
    "status": {p.name: hook.patch_status(p.name)["active"] for p in patches.patches_of("mhc")},
}, default=str))
"""

# What server_args sets on sm_120 (TileLang pre and DeepGEMM hc-prenorm off); the TileLang post is
# switched off too so that upstream's own torch post runs on this CPU box.
SM120_ENV = {"SGLANG_OPT_USE_TILELANG_MHC_PRE": "0", "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
             "SGLANG_OPT_USE_TILELANG_MHC_POST": "0"}


def _probe(hook_env, code: str, *args: str, env: dict, timeout: int = 300):
    r = hook_env.probe_code(code, *args, env=env, timeout=timeout)
    return r, r.result, r.hook_lines


def test_registry_covers_the_models_four_mhc_seams():
    assert {(p.target_module, p.target_attr) for p in SPECS} == {
        (DSV4, "DeepseekV4DecoderLayer.hc_pre"), (DSV4, "DeepseekV4DecoderLayer.hc_post"),
        (DSV4, "mhc_fused_post_pre"), (DSV4, "_is_fused_mhc_post_pre_enabled")}
    assert {p.switch_env for p in SPECS} == {"V4FLASH_MHC"}


def test_import_swaps_all_four_and_the_model_would_fuse(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={})
    assert p.rc == 0, p.stderr[-4000:]
    assert all(res["seen"].values()), res["seen"]
    assert all(st["active"] for st in res["status"].values()), res["status"]
    active = [ln for ln in lines if "mHC" in ln]
    assert len(active) == 4 and all("ACTIVE" in ln for ln in active), p.stderr


def test_status_cli_decides_the_mhc_patches(hook_env):
    """`python -m v4flash_kernels.hook.hook` (what doctor runs) imports the model module and reports them."""
    import json

    p = hook_env.python_args("-m", "v4flash_kernels.hook.hook")
    assert p.returncode == 0, p.stderr[-4000:]
    st = json.loads(p.stdout)["patches"]
    assert all(st[s.name]["active"] and st[s.name]["decided"] for s in SPECS), {s.name: st[s.name] for s in SPECS}


def test_switch_off_leaves_all_four_upstream(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={"V4FLASH_MHC": "0"})
    assert p.rc == 0, p.stderr[-4000:]
    assert not any(res["seen"].values()), res["seen"]
    assert not any(st["active"] for st in res["status"].values())
    assert all("V4FLASH_MHC=0" in st["reason"] for st in res["status"].values())
    assert not any("WARNING" in ln for ln in lines if "mHC" in ln), lines


@pytest.mark.timeout(900)
def test_model_forward_reaches_ours_on_and_upstream_off_with_the_same_result(hook_env, tmp_path):
    runs = {}
    for mode, extra in (("on", {}), ("off", {"V4FLASH_MHC": "0"})):
        out = tmp_path / f"{mode}.pt"
        p, res, _ = _probe(hook_env, CONSUMER, "128", "3", str(out),
                           env={"TRITON_INTERPRET": "1", **SM120_ENV, **extra}, timeout=800)
        assert p.rc == 0, p.stderr[-4000:]
        runs[mode] = (res, torch.load(out, weights_only=False))
    on, off = runs["on"][0], runs["off"][0]
    # On: the fused structure, all ours: first pre, three fused boundaries, the final post.
    assert on["use_fused"] == [True, True, True] and all(on["status"].values())
    assert on["entered"] == ["ours.hc_pre", "ours.fused", "ours.fused", "ours.fused", "ours.hc_post"], on["entered"]
    # Off: upstream's sm_120 path, unfused: pre (torch + Sinkhorn) and post for all four sub-layers.
    assert off["use_fused"] == [False, False, False] and not any(off["status"].values())
    assert off["entered"] == ["upstream.hc_pre", "upstream.sinkhorn", "upstream.hc_post"] * 4, off["entered"]
    for key in ("hidden", "pre_head"):
        a, b = runs["on"][1][key], runs["off"][1][key]
        assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
        # Two layers, four boundaries: the two paths round the same values (identical here but for a
        # rare one-ulp bf16 flip), far inside one bf16 rounding of the output.
        assert R.max_rel(a, b.double()) <= 5e-3, (key, R.max_rel(a, b.double()))
