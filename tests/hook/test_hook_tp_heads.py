"""The sparse-decode patch at attention-TP > 1, against the real pinned sglang wheel (CPU, interpreter).

Each scenario runs in a fresh interpreter of the hook venv (our wheel installed with its .pth over
the pinned sglang): SGLang's attention-TP rank/size functions are replaced by fakes before the
first call (the only stand-in; no process group exists on CPU), then SGLang's own dispatcher
`flash_mla_with_kvcache_sm120` is called the way the DeepSeek-V4 backend calls it, with a q whose
heads outside this rank's slice hold NaN/Inf/3e38 like the model's uninitialised pad. The kept
upstream function, on the clean slice, is the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SCENARIO = r"""
import json, os, sys
sys.path.insert(0, {here!r})
import probe
probe._interpreter_shims()
import torch
from sglang.srt.layers import dp_attention
import sglang.srt.layers.attention.flash_mla_sm120 as disp
import sglang.srt.layers.attention.flash_mla_sm120_triton as target
from v4flash_kernels.attention import op as decode
from v4flash_kernels.hook import hook
from v4flash_kernels.hook import patches
from v4flash_kernels.attention import reference as R
from v4flash_kernels.kit.compare import rel_err

rank, size, heads = {rank}, {size}, {heads}
dp_attention.get_attention_tp_rank = lambda: rank
dp_attention.get_attention_tp_size = lambda: size
n = heads // size
keep = slice(rank * n, (rank + 1) * n)

case = R.Case(batch=2, heads=heads, width=64, page_size=64, extra_width=64, extra_page_size=64, hole_frac=0.05)
kw = R.make_inputs(case, seed=5)
clean = {{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}}
garbage = (float("nan"), float("inf"), float("-inf"), 3.0e38)
for h in range(heads):
    if not keep.start <= h < keep.stop:
        kw["q"][:, :, h] = garbage[h % 4]

seen = []
real_run = decode.run
def spy(*a, **k):
    seen.append(k.get("head_range"))
    return real_run(*a, **k)
decode.run = spy

call_kw = dict(kw, extra_indices_in_kvcache=kw.pop("extra_indices"))
out, lse = disp.flash_mla_with_kvcache_sm120(**call_kw)
dp_attention.get_attention_tp_rank = lambda: (rank + 1) % size  # the range is read once per process
out2, _ = disp.flash_mla_with_kvcache_sm120(**call_kw)

upstream = getattr(target, hook.upstream_keep_attr(patches.SPARSE_DECODE))
sub = dict(clean, q=clean["q"][:, :, keep], attn_sink=clean["attn_sink"][keep])
up_out, up_lse = upstream(**sub)
ref_out, ref_lse = R.sparse_mla_decode_ref(**sub)
mine, ml = out[:, :, keep], lse[:, keep]
print("RESULT " + json.dumps(dict(
    installed=f"{{target.flash_mla_sparse_decode_triton.__module__}}.{{target.flash_mla_sparse_decode_triton.__qualname__}}",
    active=hook.status()["patches"]["sparse_decode"]["active"],
    head_ranges=[list(r) if r else None for r in seen],
    nan=bool(torch.isnan(mine.float()).any() or torch.isnan(ml).any()),
    err_up=rel_err(mine, up_out), err_ref=rel_err(mine, ref_out),
    lse_err=float((ml.double() - up_lse.double()).abs().max()),
    same_second_call=bool(torch.equal(out2[:, :, keep], mine)),
    shapes=[list(out.shape), list(lse.shape)],
)))
"""


def _scenario(hook_env, rank: int, size: int, heads: int) -> dict:
    code = SCENARIO.format(here=str(HERE), rank=rank, size=size, heads=heads)
    p = hook_env.python_c(code, env={"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow  # both kernels under the Triton interpreter
@pytest.mark.parametrize("rank,size,heads", [(1, 4, 16), (3, 4, 16), (1, 2, 16)],
                         ids=["tp4_rank1", "tp4_rank3", "tp2_rank1"])
def test_patched_call_computes_only_this_ranks_heads(hook_env, rank, size, heads):
    res = _scenario(hook_env, rank, size, heads)
    n = heads // size
    assert res["active"] is True
    assert res["installed"].startswith("v4flash_kernels.hook.tp_heads.make_tp_aware")
    assert res["head_ranges"] == [[rank * n, (rank + 1) * n]] * 2  # read once, kept for the process
    assert res["same_second_call"]
    assert not res["nan"], "garbage from the other heads reached this rank's output"
    assert res["err_up"] < 1e-2 and res["err_ref"] < 1e-2, res
    assert res["lse_err"] < 1e-3
    assert res["shapes"] == [[2, 1, heads, 512], [2, heads, 1]]  # upstream's layout: all heads, caller slices


@pytest.mark.slow
def test_tp1_computes_every_head_like_upstream(hook_env):
    res = _scenario(hook_env, 0, 1, 8)
    assert res["active"] is True
    assert res["head_ranges"] == [None, None]
    assert not res["nan"] and res["err_up"] < 1e-2 and res["err_ref"] < 1e-2


def test_identity_reports_the_adapter_around_ours(hook_env):
    run = hook_env.run("identity")
    assert run.rc == 0, run.stderr
    assert run.result["is_ours"] and run.result["fn"] == "v4flash_kernels.attention.op.sparse_mla_decode"
    assert run.result["adapter"] == "v4flash_kernels.hook.tp_heads.make_tp_aware.<locals>.flash_mla_sparse_decode_triton"
