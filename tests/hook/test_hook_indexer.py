"""The indexer patch against the real pinned sglang 0.5.13.post1 wheel, each scenario in a fresh interpreter.

The consumer scenario runs SGLang's own `C4IndexerBackendMixin.forward_c4_indexer` (the caller that
looks `fp8_paged_mqa_logits_torch_sm120` up as a module global at call time, then feeds the logits
to its top-512 transform) on CPU under TRITON_INTERPRET=1, with stand-ins only for the attention
backend's state (metadata holder, the q/weights/cache producer) and the hardware probe
`is_sm120_supported` (forced True: this box has no sm_120). Patched and unpatched runs must enter
the function they claim and select the same positions as the fp64 reference.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.indexer.reference import logits_error, reference_for

TARGET = "sglang.srt.layers.attention.dsv4.indexer"
UPSTREAM = f"{TARGET}.fp8_paged_mqa_logits_torch_sm120"
OURS = "v4flash_kernels.indexer.op.fp8_paged_mqa_logits"

IDENTITY = """
import importlib, json, os
mod = importlib.import_module("sglang.srt.layers.attention.dsv4.indexer")
fn = mod.fp8_paged_mqa_logits_torch_sm120
caller_sees = mod.C4IndexerBackendMixin.forward_c4_indexer.__globals__["fp8_paged_mqa_logits_torch_sm120"]
from v4flash_kernels.hook import hook
from v4flash_kernels.indexer import op as indexer
print("PROBE-JSON " + json.dumps({
    "pid": os.getpid(), "fn": f"{fn.__module__}.{fn.__qualname__}",
    "is_ours": fn is indexer.fp8_paged_mqa_logits, "caller_sees_ours": caller_sees is indexer.fp8_paged_mqa_logits,
    "status": hook.patch_status("indexer"),
}, default=str))
"""

CONSUMER = """
import importlib, json, os, sys
from types import SimpleNamespace

from v4flash_kernels.interpreter import fix_index  # numpy >= 2.4 vs Triton 3.6's interpreter
fix_index()

import torch
ix = importlib.import_module("sglang.srt.layers.attention.dsv4.indexer")
from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata
from v4flash_kernels.hook import hook
from v4flash_kernels.indexer.reference import IndexerCase, make_indexer_inputs

ix.is_sm120_supported = lambda: True  # the sm_120 branch of forward_c4_indexer on this CPU box
seed, out_path = int(sys.argv[1]), sys.argv[2]
kw = make_indexer_inputs(IndexerCase(batch=4, width=20, lengths=[1200, 300, 700], pad_rows=1), seed=seed)
B = kw["q_fp8"].shape[0]
q, weights = kw["q_fp8"][:, 0], kw["weight"].unsqueeze(-1)
cache2d = kw["kvcache_fp8"].view(kw["kvcache_fp8"].shape[0], -1)
meta = PagedIndexerMetadata(page_size=256, page_table=kw["page_table"], c4_seq_lens=kw["seq_lens"].reshape(-1))
core = SimpleNamespace(positions=torch.zeros(B, dtype=torch.int64), page_table=meta.page_table,
                       c4_sparse_page_indices=torch.full((B, 512), -7, dtype=torch.int32),
                       c4_sparse_raw_indices=torch.full((B, 512), -7, dtype=torch.int32))
backend = SimpleNamespace(
    token_to_kv_pool=None, debug_use_external_c4_sparse_indices=False, hisparse_coordinator=None,
    forward_metadata=SimpleNamespace(indexer_metadata=meta, core_metadata=core),
    _forward_prepare_normal=lambda **_: (q, weights, cache2d),
)
batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False, is_decode=lambda: True))
who = {("v4flash_kernels/indexer/op.py", "fp8_paged_mqa_logits"): "ours",
       ("attention/dsv4/indexer.py", "fp8_paged_mqa_logits_torch_sm120"): "upstream"}
entered, returned = [], []
def prof(frame, event, arg):
    key = next((w for (suffix, name), w in who.items() if frame.f_code.co_name == name
                and frame.f_code.co_filename.replace(os.sep, "/").endswith(suffix)), None)
    if key and event == "call":
        entered.append(key)
    elif key and event == "return" and not returned:
        returned.append(arg)
x = torch.zeros(B, 8)
sys.setprofile(prof)
try:
    ix.C4IndexerBackendMixin.forward_c4_indexer(backend, x=x, q_lora=x, c4_indexer=SimpleNamespace(
        layer_id=0, use_fp4_indexer=False), forward_batch=batch)
finally:
    sys.setprofile(None)
torch.save({"kw": kw, "logits": returned[0], "pages": core.c4_sparse_page_indices,
            "raw": core.c4_sparse_raw_indices}, out_path)
print("PROBE-JSON " + json.dumps({"entered": entered, "status": hook.patch_status("indexer")}, default=str))
"""

# sm_120's settings for the indexer path, with the torch top-k so the whole consumer runs on CPU.
CONSUMER_ENV = {"TRITON_INTERPRET": "1", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
                "SGLANG_TOPK_TRANSFORM_512_TORCH": "1", "SGLANG_OPT_USE_TOPK_V2": "0"}


def _probe(hook_env, code: str, *args: str, env: dict, timeout: int = 240) -> tuple:
    r = hook_env.probe_code(code, *args, env=env, timeout=timeout)
    return r, r.result, r.hook_lines


def test_import_swaps_the_function_the_caller_looks_up(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={})
    assert p.rc == 0, p.stderr
    assert res["is_ours"] and res["caller_sees_ours"] and res["fn"] == OURS
    st = res["status"]
    assert st["active"] is True, st
    line = [ln for ln in lines if "indexer logits" in ln]  # the module hosts the top-512 patch too
    assert len(line) == 1 and "ACTIVE" in line[0] and UPSTREAM in line[0] and OURS in line[0], p.stderr


def test_switch_off_leaves_upstream(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={"V4FLASH_INDEXER": "0"})
    assert p.rc == 0, p.stderr
    assert not res["is_ours"] and not res["caller_sees_ours"] and res["fn"] == UPSTREAM
    st = res["status"]
    assert st["active"] is False and "V4FLASH_INDEXER=0" in st["reason"]
    assert not any("WARNING" in ln for ln in lines if "indexer" in ln.lower()), lines


@pytest.mark.timeout(900)
def test_sglang_consumer_on_and_off_select_the_same_positions(hook_env, tmp_path):
    runs = {}
    for mode, extra in (("on", {}), ("off", {"V4FLASH_INDEXER": "0"})):
        out = tmp_path / f"{mode}.pt"
        p, res, _ = _probe(hook_env, CONSUMER, "11", str(out), env={**CONSUMER_ENV, **extra}, timeout=600)
        assert p.rc == 0, p.stderr[-4000:]
        runs[mode] = (res, torch.load(out, weights_only=False))
    assert runs["on"][0]["entered"] == ["ours"] and runs["on"][0]["status"]["active"] is True
    assert runs["off"][0]["entered"] == ["upstream"] and runs["off"][0]["status"]["active"] is False

    kw = runs["on"][1]["kw"]
    ref = reference_for(kw)
    seq = kw["seq_lens"].reshape(-1).tolist()
    for mode in ("on", "off"):
        data = runs[mode][1]
        e = logits_error(data["logits"], ref)
        assert not e["nan"] and e["inf_ok"] and e["rel_err"] <= 1e-5, (mode, e)
        for b, n in enumerate(seq):
            picked = sorted(x for x in data["raw"][b].tolist() if x >= 0)
            want = sorted(torch.topk(ref[b, :n], min(512, n)).indices.tolist())
            assert picked == want, (mode, b)
    on, off = runs["on"][1], runs["off"][1]
    for b in range(len(seq)):
        assert sorted(on["pages"][b].tolist()) == sorted(off["pages"][b].tolist())
