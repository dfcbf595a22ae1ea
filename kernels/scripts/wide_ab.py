"""H200 A/B of the wide head block (decode.WIDE) vs the previous default (issue 3), with correctness.

Run on a GPU from the repo root: PYTHONPATH=kernels python kernels/scripts/wide_ab.py  (writes $OUT/screen2.json,
or ./screen2.json). Each variant is checked against the fp64 reference on NaN-poisoned outputs first.
"""
import functools
import json
import os
import time

import torch

import v4flash_bench.attention as bench
from v4flash_kernels.attention import op as decode
from v4flash_kernels.attention.reference import Case, make_inputs, sparse_mla_decode_ref
from v4flash_kernels.kit.measure import time_graph

OLD = decode.KernelConfig(block_h=16, block_t=32, num_warps=4)  # the 16-head bf16 default of 2026-11-29
SHAPES = [("c4", 64, 64), ("c128@256K", 64, 64), ("c128@128K", 64, 64), ("c4", 16, 64),
          ("c128@256K", 16, 64), ("c128@128K", 16, 64), ("swa", 64, 64), ("swa", 16, 64),
          ("c4", 4, 64), ("c128@256K", 4, 64), ("c4", 32, 64)]
out_path = os.path.join(os.environ.get("OUT", "."), "screen2.json")
rows = []
t_start = time.time()
for i, (kind, B, H) in enumerate(SHAPES):
    if time.time() - t_start > 150:
        break
    case = Case(batch=B, heads=H, hole_frac=0.01, **bench.KINDS[kind])
    kw = make_inputs(case, device="cuda", seed=4321 + i)
    ref_out, ref_lse = sparse_mla_decode_ref(**kw)
    w_a, w_b = bench.cache_widths(kw)
    sms, smem = decode._device_info(kw["q"].device)
    plans = {"new_default": decode.make_plan(B, H, w_a, w_b, sms, smem_per_sm=smem),
             "new_sm120": decode.make_plan(B, H, w_a, w_b, sms, smem_per_sm=102400),
             "old_default": decode.make_plan(B, H, w_a, w_b, sms, config=OLD, ctas_per_sm=8)}
    for cps in (2, 4, 8):
        plans[f"wide/cps{cps}"] = decode.make_plan(B, H, w_a, w_b, sms, config=decode.WIDE, ctas_per_sm=cps)
    row: dict = {"kind": kind, "B": B, "H": H, "variants": {}}
    for name, p in plans.items():
        fn = bench.bind_plan(p)
        try:
            chk = bench.check_call(fn, kw, ref_out, ref_lse, poison=True)
            us = time_graph(functools.partial(fn, **kw))
            row["variants"][name] = {"ok": chk["ok"], "rel_err": chk["rel_err"], "us": round(us, 1),
                                     "plan": f"{p.config.name} chunk={p.chunk} splits={p.splits_main}+{p.splits_extra}"}
        except Exception as e:
            row["variants"][name] = {"error": repr(e)[:300]}
        v = row["variants"][name]
        print(kind, B, H, name, v.get("ok"), v.get("us"), v.get("plan", v.get("error")), flush=True)
    rows.append(row)
    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(out_path, "w"), indent=1)
    del kw, ref_out, ref_lse
    torch.cuda.empty_cache()
print("done", round(time.time() - t_start, 1))
