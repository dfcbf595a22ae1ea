"""The top-512 patch against the real pinned sglang 0.5.13.post1 wheel, each scenario in a fresh interpreter.

The indexer module imports the JIT wrapper by name (`from sglang.jit_kernel.dsv4 import
topk_transform_512`) and `C4IndexerBackendMixin.forward_c4_indexer` calls that module global, so
the patch replaces it there. The consumer scenario runs SGLang's own `forward_c4_indexer` on CPU
under TRITON_INTERPRET=1 (stand-ins only for the attention backend's state and the hardware probe
`is_sm120_supported`, as in the indexer hook test): with the patch on it must enter our function
on the JIT path (SGLANG_TOPK_TRANSFORM_512_TORCH unset, SGLANG_OPT_USE_TOPK_V2=0 as on sm_120) and
write exactly the reference's pages and positions; the JIT kernel cannot run here, so the off run
takes SGLang's torch top-k (SGLANG_TOPK_TRANSFORM_512_TORCH=1), which must select the same sets.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.topk.reference import topk_transform_ref

TARGET = "sglang.srt.layers.attention.dsv4.indexer"
UPSTREAM = f"{TARGET}.topk_transform_512"
UPSTREAM_FN = "sglang.jit_kernel.dsv4.topk.topk_transform_512"
OURS = "v4flash_kernels.topk.op.topk_transform_512"

IDENTITY = """
import importlib, json, os
mod = importlib.import_module("sglang.srt.layers.attention.dsv4.indexer")
fn = mod.topk_transform_512
caller_sees = mod.C4IndexerBackendMixin.forward_c4_indexer.__globals__["topk_transform_512"]
from v4flash_kernels.hook import hook
from v4flash_kernels.topk import op as topk
print("PROBE-JSON " + json.dumps({
    "pid": os.getpid(), "fn": f"{fn.__module__}.{fn.__qualname__}",
    "is_ours": fn is topk.topk_transform_512, "caller_sees_ours": caller_sees is topk.topk_transform_512,
    "status": hook.patch_status("topk"),
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
# rows: long (radix path, 2 grid rows), <= 512 (sequential), a CUDA-graph padding row
kw = make_indexer_inputs(IndexerCase(batch=4, width=24, lengths=[1500, 300, 1100], pad_rows=1), seed=seed)
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
who = {("v4flash_kernels/topk/op.py", "topk_transform_512"): "ours",
       ("jit_kernel/dsv4/topk.py", "topk_transform_512"): "upstream_jit",
       ("attention/dsv4/indexer.py", "topk_transform_512_pytorch_vectorized"): "upstream_torch",
       ("attention/dsv4/indexer.py", "fp8_paged_mqa_logits_torch_sm120"): "logits"}
entered, logits = [], []
def prof(frame, event, arg):
    key = next((w for (suffix, name), w in who.items() if frame.f_code.co_name == name
                and frame.f_code.co_filename.replace(os.sep, "/").endswith(suffix)), None)
    if key and event == "call":
        entered.append(key)
    elif key == "logits" and event == "return":
        logits.append(arg)
x = torch.zeros(B, 8)
sys.setprofile(prof)
try:
    ix.C4IndexerBackendMixin.forward_c4_indexer(backend, x=x, q_lora=x, c4_indexer=SimpleNamespace(
        layer_id=0, use_fp4_indexer=False), forward_batch=batch)
finally:
    sys.setprofile(None)
torch.save({"seq": kw["seq_lens"].reshape(-1), "table": kw["page_table"], "logits": logits[0],
            "pages": core.c4_sparse_page_indices, "raw": core.c4_sparse_raw_indices}, out_path)
print("PROBE-JSON " + json.dumps({"entered": entered, "status": hook.patch_status("topk")}, default=str))
"""

# sm_120's settings for the indexer path (torch logits, v1 JIT top-k); the logits are upstream's in
# both runs (V4FLASH_INDEXER=0) so only the top-k differs.
CONSUMER_ENV = {"TRITON_INTERPRET": "1", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1", "SGLANG_OPT_USE_TOPK_V2": "0",
                "V4FLASH_INDEXER": "0"}


def _probe(hook_env, code: str, *args: str, env: dict, timeout: int = 240) -> tuple:
    r = hook_env.probe_code(code, *args, env=env, timeout=timeout)
    return r, r.result, r.hook_lines


def test_import_swaps_the_name_the_indexer_calls(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={})
    assert p.rc == 0, p.stderr
    assert res["is_ours"] and res["caller_sees_ours"] and res["fn"] == OURS
    assert res["status"]["active"] is True, res["status"]
    line = [ln for ln in lines if "top-512" in ln]
    assert len(line) == 1 and "ACTIVE" in line[0] and UPSTREAM in line[0] and OURS in line[0], p.stderr


def test_switch_off_leaves_upstream(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={"V4FLASH_TOPK": "0"})
    assert p.rc == 0, p.stderr
    assert not res["is_ours"] and not res["caller_sees_ours"] and res["fn"] == UPSTREAM_FN
    st = res["status"]
    assert st["active"] is False and "V4FLASH_TOPK=0" in st["reason"]
    assert not any("WARNING" in ln for ln in lines if "top-512" in ln), lines


@pytest.mark.timeout(900)
def test_sglang_consumer_on_matches_the_reference_and_off_selects_the_same_sets(hook_env, tmp_path):
    runs = {}
    for mode, extra in (("on", {}), ("off", {"V4FLASH_TOPK": "0", "SGLANG_TOPK_TRANSFORM_512_TORCH": "1"})):
        out = tmp_path / f"{mode}.pt"
        p, res, _ = _probe(hook_env, CONSUMER, "13", str(out), env={**CONSUMER_ENV, **extra}, timeout=600)
        assert p.rc == 0, p.stderr[-4000:]
        runs[mode] = (res, torch.load(out, weights_only=False))
    assert runs["on"][0]["entered"] == ["logits", "ours"] and runs["on"][0]["status"]["active"] is True
    assert runs["off"][0]["entered"] == ["logits", "upstream_torch"] and runs["off"][0]["status"]["active"] is False

    on, off = runs["on"][1], runs["off"][1]
    assert torch.equal(on["logits"], off["logits"])
    want_pages, want_raw = topk_transform_ref(on["logits"], on["seq"].to(torch.int32), on["table"], 512, 64)
    assert torch.equal(on["raw"], want_raw) and torch.equal(on["pages"], want_pages)
    for b in range(on["raw"].shape[0]):  # the torch version's order is torch.topk's: compare sets
        assert sorted(on["raw"][b].tolist()) == sorted(off["raw"][b].tolist()), b
        assert sorted(on["pages"][b].tolist()) == sorted(off["pages"][b].tolist()), b
