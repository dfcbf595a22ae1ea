"""A speculative-decoding verify step through the real pinned sglang 0.5.13.post1 wheel, hook on and off.

The scenario runs SGLang's own code of a TARGET_VERIFY forward on CPU under TRITON_INTERPRET=1, for
a TP4 decode worker with EAGLE (top-k 1, 3 draft steps: 4 rows per request) and 2 requests whose
rows cross the edges that matter (a c128 entry and the SWA window at a 128-token boundary; c4
length 512 -> 513, where the top-512 stops keeping every position):

1. the metadata: `DeepseekV4AttnBackend.init_forward_metadata_target_verify` then
   `init_forward_metadata_in_graph` (the CUDA-graph path SGLang takes by default: the raw verify
   metadata outside the graph, `make_forward_metadata_from_raw_verify` inside it: rows, lengths,
   page tables, SWA indices, the Triton compression-metadata kernel), or with
   SGLANG_PREP_IN_CUDA_GRAPH=0 the eager path (`init_forward_metadata_target_verify_old`: the
   prefill metadata, with the top-512's raw positions);
2. the c4 indexer: `C4IndexerBackendMixin.forward_c4_indexer` (the logits function and the top-512
   it looks up at call time, writing the c4 page indices into the metadata);
3. attention of a SWA-only, a c4 and a c128 layer: the backend's own `forward` (its sm_120 branch,
   `flash_mla_with_kvcache_sm120`, which looks the sparse decode up at call time).

Stand-ins only for what a loaded worker holds or this CPU box lacks: the backend's state as its
`__init__` leaves it (built with `__new__`), the memory pool's accessors (random real-layout pools
from tests/kernels/verify_rows.py, the full-to-SWA map), `_move_to_device` (a pinned host copy:
no pinned allocator on a CPU box), the indexer's q/weights producer
(`_forward_prepare_normal`: its fused q kernel is CUDA-only), the hardware probes (`is_sm120_supported`,
`_is_sm120` forced True; `_create_flashmla_metadata` returns None as on sm_120) and the compressor's
plan (`create_paged_compressor_data`: GPU planners, read by no op under test).

Hook on: ours must run for the logits, the top-512 and all three attention calls. Hook off: upstream's
torch logits and torch top-512 (SGLang's JIT top-512 needs CUDA; its own fallback), and upstream's torch
sparse decode (SGLANG_SM120_TRITON_FLASHMLA=0: its Triton kernel takes minutes under the interpreter;
tests/kernels/test_verify_shapes_cpu.py compares that one on verify rows). Both runs are checked
against the fp64 references on the inputs they produced, and against each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from v4flash_kernels.attention.reference import sparse_mla_decode_ref
from v4flash_kernels.indexer.reference import indexer_logits_ref, logits_error
from v4flash_kernels.kit.compare import rel_err
from v4flash_kernels.topk.reference import topk_transform_ref

ROWS_DIR = str(Path(__file__).resolve().parents[1] / "kernels")  # verify_rows.py

CONSUMER = """
import json, os, sys
from types import SimpleNamespace

from v4flash_kernels.interpreter import fix_index  # numpy >= 2.4 vs Triton 3.6's interpreter
fix_index()

import torch
seed, out_path, rows_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, rows_dir)
import verify_rows as V
import sglang.srt.layers.attention.deepseek_v4_backend as dsv4
import sglang.srt.layers.attention.dsv4.indexer as ix
from v4flash_kernels.hook import hook

ix.is_sm120_supported = lambda: True  # the sm_120 branches on this CPU box
dsv4._is_sm120 = True
dsv4._create_flashmla_metadata = lambda: None  # what it returns on sm_120
dsv4.create_paged_compressor_data = lambda **kw: None  # the compressor's GPU plan: no op under test reads it

CONTEXT, K, BS, HEADS = 4096, 3, 2, 4
g = torch.Generator().manual_seed(seed)
batch = V.draw_batch(BS, K, CONTEXT, g)
lay = V.make_layout(batch, CONTEXT, g)
rows = batch.rows
# req_to_token: request r's position p at full location table[r, p // 256] * 256 + p % 256, 0 past its tokens.
pos = torch.arange(CONTEXT)
req_to_token = (lay.table[:, pos // 256].long() * 256 + pos % 256).to(torch.int32)
for r, L in enumerate(batch.committed):
    req_to_token[r, L + K + 1:] = 0
slots, first = V.swa_slots(batch, g)
full_to_swa = torch.zeros(lay.num_pages * 256 + 1, dtype=torch.int64)
full_to_swa[-1] = -1  # SGLang's map ends in one -1, so -1 maps to -1
for r in range(batch.requests):
    full_to_swa[req_to_token[r, first[r] + torch.arange(slots.shape[1])].long()] = slots[r]
swa = V.mla_pool(-(-slots.numel() // 128), 128, g)
c4 = V.mla_pool(lay.num_pages, 64, g)
c128 = V.mla_pool(lay.num_pages, 2, g)
ikw = V.indexer_inputs(lay, g)
index_2d = ikw["kvcache_fp8"].view(lay.num_pages, -1)
extra = {1: V.pool_bytes(c4), 2: V.pool_bytes(c128)}
# The memory pool: the backend checks its class; these are the accessors it calls, same layouts.
pool = dsv4.DeepSeekV4TokenToKVPool.__new__(dsv4.DeepSeekV4TokenToKVPool)
pool.__dict__.update(
    translate_loc_from_full_to_swa=lambda loc: full_to_swa[loc],
    get_swa_key_buffer_radix=lambda layer_id: V.pool_bytes(swa),
    get_extra_key_buffer=lambda layer_id: extra[layer_id],
    get_index_k_with_scale_buffer=lambda layer_id: index_2d,
    swa_window_size=128, swa_kv_pool=SimpleNamespace(kv_cache_total_dim=584), page_size=256,
)
# The backend as __init__ leaves it on a TP4 decode worker with EAGLE (top-k 1, K steps, K + 1 draft tokens).
be = dsv4.DeepseekV4AttnBackend.__new__(dsv4.DeepseekV4AttnBackend)
be.__dict__.update(
    device=torch.device("cpu"), cuda_int32_kwargs={"device": torch.device("cpu"), "dtype": torch.int32},
    softmax_scale=512 ** -0.5, head_dim_v=512, swa_page_size=128, page_size=256, req_to_token=req_to_token,
    token_to_kv_pool=pool, hisparse_coordinator=None, MAX_SEQ_LEN_FOR_CAPTURE=CONTEXT, c4_topk=512,
    enable_deepseek_v4_fp4_indexer=False, topk=1, mtp_enabled=True, speculative_num_steps=K,
    speculative_num_draft_tokens=K + 1, speculative_step_id=0, forward_metadata=None,
    debug_use_external_c4_sparse_indices=False,
    # a pinned host tensor copied to the GPU; on a CPU box (no pinned allocator) the tensor itself
    _move_to_device=lambda values: torch.tensor(values, dtype=torch.int32),
)
mode = SimpleNamespace(is_target_verify=lambda: True, is_decode_or_idle=lambda: False, is_idle=lambda: False,
                       is_decode=lambda: False, is_extend_without_speculative=lambda: False)
seq = torch.tensor(batch.committed, dtype=torch.int32)
out_loc = torch.zeros(rows, dtype=torch.int64)
fb = SimpleNamespace(forward_mode=mode, out_cache_loc=out_loc, batch_size=BS, seq_lens=seq,
                     req_pool_indices=torch.arange(BS))

who = {("v4flash_kernels/attention/op.py", "sparse_mla_decode"): "attention:ours",
       ("attention/flash_mla_sm120_triton.py", "flash_mla_sparse_decode_triton"): "attention:upstream_triton",
       ("attention/flash_mla_sm120.py", "_sm120_sparse_decode_fwd"): "attention:upstream_torch",
       ("v4flash_kernels/indexer/op.py", "fp8_paged_mqa_logits"): "logits:ours",
       ("attention/dsv4/indexer.py", "fp8_paged_mqa_logits_torch_sm120"): "logits:upstream",
       ("v4flash_kernels/topk/op.py", "topk_transform_512"): "topk:ours",
       ("attention/dsv4/indexer.py", "topk_transform_512_pytorch_vectorized"): "topk:upstream_torch",
       ("jit_kernel/dsv4/topk.py", "topk_transform_512"): "topk:upstream_jit"}
entered, logits = [], []
def prof(frame, event, arg):
    code = frame.f_code
    key = next((w for (suffix, name), w in who.items() if code.co_name == name
                and code.co_filename.replace(os.sep, "/").endswith(suffix)), None)
    if key and event == "call":
        entered.append(key)
    elif key and key.startswith("logits") and event == "return":
        logits.append(arg)

# 1. the verify metadata (graph path: raw outside the graph, upgraded inside it; eager: the old path)
raw = be.init_forward_metadata_target_verify(max_seq_len=CONTEXT, req_pool_indices=fb.req_pool_indices,
                                             seq_lens=seq, out_cache_loc=out_loc)
be.forward_metadata = raw
be.init_forward_metadata_in_graph(fb)
meta = be.forward_metadata
core = meta.core_attn_metadata
# 2. the c4 indexer; 3. attention of a SWA-only, a c4 and a c128 layer
q_idx, w_idx = ikw["q_fp8"][:, 0], ikw["weight"].unsqueeze(-1)
be._forward_prepare_normal = lambda **_: (q_idx, w_idx, index_2d)
x = torch.zeros(rows, 8)
qa = torch.randn((rows, HEADS, 512), generator=g).to(torch.bfloat16)
sink = torch.randn(HEADS, generator=g) * 2.0
attn = {}
sys.setprofile(prof)
try:
    ix.C4IndexerBackendMixin.forward_c4_indexer(be, x=x, q_lora=x, c4_indexer=SimpleNamespace(
        layer_id=1, use_fp4_indexer=False), forward_batch=fb)
    for ratio, lid in ((0, 0), (4, 1), (128, 2)):
        attn[ratio] = be.forward(qa, qa, qa, SimpleNamespace(layer_id=lid, v_head_dim=512), fb, compress_ratio=ratio,
                                 save_kv_cache=False, attn_sink=sink)
finally:
    sys.setprofile(None)
fields = ("seq_lens_casual", "page_table", "swa_page_indices", "swa_topk_lengths", "c4_sparse_page_indices",
          "c4_sparse_topk_lengths", "c128_page_indices", "c128_topk_lengths_clamp1", "c4_sparse_raw_indices")
torch.save({"committed": batch.committed, "k": K, "logits": logits[0], "attn": attn, "q": qa, "sink": sink,
            "swa": swa, "c4": c4, "c128": c128, "ikw": ikw, "c4_seq_lens": meta.indexer_metadata.c4_seq_lens,
            "table": lay.table, "meta": {f: getattr(core, f) for f in fields}}, out_path)
print("PROBE-JSON " + json.dumps({"entered": entered, "raw": type(raw).__name__, "full": type(meta).__name__,
                                  "status": {n: hook.patch_status(n) for n in ("sparse_decode", "indexer", "topk")}},
                                 default=str))
"""

# sm_120's settings for the indexer path (torch logits, the v1 top-512).
BASE_ENV = {"TRITON_INTERPRET": "1", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1", "SGLANG_OPT_USE_TOPK_V2": "0"}
OFF_ENV = {"V4FLASH_SPARSE_DECODE": "0", "V4FLASH_INDEXER": "0", "V4FLASH_TOPK": "0",
           "SGLANG_TOPK_TRANSFORM_512_TORCH": "1", "SGLANG_SM120_TRITON_FLASHMLA": "0"}
OURS = ["logits:ours", "topk:ours", "attention:ours", "attention:ours", "attention:ours"]
UPSTREAM = ["logits:upstream", "topk:upstream_torch"] + ["attention:upstream_torch"] * 3


def _run(hook_env, tmp_path: Path, name: str, env: dict) -> tuple:
    out = tmp_path / f"{name}.pt"
    r = hook_env.probe_code(CONSUMER, "17", str(out), ROWS_DIR, env={**BASE_ENV, **env}, timeout=600)
    assert r.rc == 0, r.stderr[-4000:]
    return r.result, torch.load(out, weights_only=False)


def _check_verify_metadata(d: dict, eager: bool) -> None:
    """The rows the backend built are a verify batch: k + 1 consecutive lengths per request over its
    page table, c4 lengths s // 4, the SWA window shifted one token per row, the edges crossed."""
    k, committed = d["k"], d["committed"]
    m = d["meta"]
    want = torch.tensor([L + 1 + j for L in committed for j in range(k + 1)])
    assert torch.equal(m["seq_lens_casual"].long(), want)
    assert torch.equal(d["c4_seq_lens"].long(), want // 4)
    per_request = want.view(len(committed), k + 1)
    assert any({512, 513} <= set((s // 4).tolist()) for s in per_request)  # the top-512 starts selecting
    assert any(len(set((s // 128).tolist())) > 1 for s in per_request)  # a c128 entry appears
    req = torch.arange(len(committed)).repeat_interleave(k + 1)
    assert torch.equal(m["page_table"], d["table"][req])
    swa = m["swa_page_indices"].view(len(committed), k + 1, -1)
    assert torch.equal(swa[:, 1:, 1:], swa[:, :-1, :-1])
    assert torch.equal(m["swa_topk_lengths"].long(), want.clamp(max=128))
    assert (m["c4_sparse_raw_indices"] is not None) == eager


def _check_logits_and_topk(d: dict, exact_topk: bool) -> torch.Tensor:
    """Logits against fp64; the c4 page indices the top-512 wrote: exactly the reference's on these
    logits (ours) or its sets (upstream's torch order), and every selection a true top-512 of the
    fp64 logits up to fp32 near-ties. Returns the fp64 logits."""
    m, kw = d["meta"], d["ikw"]
    ref = indexer_logits_ref(kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], d["c4_seq_lens"], m["page_table"],
                             d["logits"].shape[1])
    e = logits_error(d["logits"], ref)
    assert not e["nan"] and e["inf_ok"] and e["rel_err"] <= 1e-5, e
    lens = d["c4_seq_lens"].to(torch.int32)
    pages, raw = topk_transform_ref(d["logits"], lens, m["page_table"], 512, 64)
    got = m["c4_sparse_page_indices"]
    if exact_topk:
        assert torch.equal(got, pages)
    else:
        assert torch.equal(torch.sort(got, dim=1).values, torch.sort(pages, dim=1).values)
    if m["c4_sparse_raw_indices"] is not None:
        got_raw = m["c4_sparse_raw_indices"]
        assert torch.equal(torch.sort(got_raw, dim=1).values, torch.sort(raw, dim=1).values)
    scale = ref[torch.isfinite(ref)].abs().max()
    for b, n in enumerate(lens.tolist()):
        sel = raw[b][raw[b] >= 0].long()
        if n <= 512:
            assert sorted(sel.tolist()) == list(range(n))
        else:
            kth = torch.topk(ref[b, :n], 512).values[-1]
            assert sel.numel() == 512 and ref[b, sel].min() >= kth - 1e-6 * scale
    return ref


def _attention_refs(d: dict) -> dict:
    """fp64 attention of each layer kind on exactly what the backend handed the kernel."""
    m = d["meta"]
    R = d["q"].shape[0]
    extras = {0: (None, None, None), 4: (d["c4"], m["c4_sparse_page_indices"], m["c4_sparse_topk_lengths"]),
              128: (d["c128"], m["c128_page_indices"], m["c128_topk_lengths_clamp1"])}
    out = {}
    for ratio, (cache, idx, length) in extras.items():
        o, _ = sparse_mla_decode_ref(d["q"].unsqueeze(1), d["swa"], m["swa_page_indices"].view(R, 1, -1),
                                     m["swa_topk_lengths"], d["sink"], 512, 512 ** -0.5, cache,
                                     None if idx is None else idx.view(R, 1, -1), length)
        out[ratio] = o[:, 0]
    return out


@pytest.mark.slow  # our kernels under the Triton interpreter inside the real wheel's verify step
@pytest.mark.timeout(1200)
def test_verify_step_graph_path_on_and_off(hook_env, tmp_path):
    on_res, on = _run(hook_env, tmp_path, "on", {})
    off_res, off = _run(hook_env, tmp_path, "off", OFF_ENV)
    assert on_res["entered"] == OURS, on_res["entered"]
    assert off_res["entered"] == UPSTREAM, off_res["entered"]
    for res in (on_res, off_res):
        assert (res["raw"], res["full"]) == ("DSV4RawVerifyMetadata", "DSV4Metadata")
    assert all(on_res["status"][n]["active"] is True for n in ("sparse_decode", "indexer", "topk")), on_res["status"]
    assert not any(off_res["status"][n]["active"] for n in ("sparse_decode", "indexer", "topk")), off_res["status"]
    for k, v in on["ikw"].items():  # same seed -> the same inputs in both interpreters
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, off["ikw"][k]), k
    assert torch.equal(on["q"], off["q"]) and torch.equal(on["c4"], off["c4"])
    for d, ours in ((on, True), (off, False)):
        _check_verify_metadata(d, eager=False)
        _check_logits_and_topk(d, exact_topk=ours)
        for ratio, ref in _attention_refs(d).items():
            assert not torch.isnan(d["attn"][ratio].float()).any()
            assert rel_err(d["attn"][ratio], ref) <= 1e-2, (ours, ratio)
    fin = torch.isfinite(off["logits"])
    assert torch.equal(fin, torch.isfinite(on["logits"]))
    assert (on["logits"][fin] - off["logits"][fin]).abs().max() <= 1e-5 * off["logits"][fin].abs().max()
    for ratio in (0, 4, 128):  # both answer the same verify step (the c4 selections may differ at fp32 ties)
        assert rel_err(on["attn"][ratio], off["attn"][ratio].double()) <= 2e-2, ratio


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_verify_step_eager_path_reaches_ours(hook_env, tmp_path):
    """SGLANG_PREP_IN_CUDA_GRAPH=0 (a verify outside the captured graphs builds its metadata eagerly as
    a prefill, with the top-512's raw positions): ours for every call, right against fp64."""
    res, d = _run(hook_env, tmp_path, "eager", {"SGLANG_PREP_IN_CUDA_GRAPH": "0"})
    assert res["entered"] == OURS, res["entered"]
    assert res["raw"] == res["full"] == "DSV4Metadata"
    _check_verify_metadata(d, eager=True)
    _check_logits_and_topk(d, exact_topk=True)
    for ratio, ref in _attention_refs(d).items():
        assert rel_err(d["attn"][ratio], ref) <= 1e-2, ratio
