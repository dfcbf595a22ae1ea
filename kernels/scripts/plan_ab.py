"""H200 A/B of split sizes for the wide head block at B=64 x 64 heads (issue 3's two missed targets).

Planner-only: every variant is `decode.WIDE` with an explicit `Plan` (tiles per split), so the binary
is the shipped one and only the grid changes. Each plan is checked against the fp64 reference on
NaN-poisoned outputs before it is timed (CUDA-graph replay, L2 flushed, median), all in one run
next to the plan the planner picks today.

    PYTHONPATH=kernels python kernels/scripts/plan_ab.py            # on the GPU; writes $OUT/plan_ab.json
    PYTHONPATH=kernels python kernels/scripts/plan_ab.py --dry-run  # anywhere: print the plans
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

from v4flash_kernels.attention import op as decode

# (kind, B, H, extra width) -> tiles-per-split values to try besides the planner's own choice.
SHAPES: tuple[tuple[str, int, int, int, tuple[int, ...]], ...] = (
    ("c4", 64, 64, 512, (3, 4, 6, 8)),
    ("c128@256K", 64, 64, 2048, (9, 11, 13, 22, 32)),
    ("c128@128K", 64, 64, 1024, (6, 7, 11, 16)),
)
WIDTH_MAIN = 128
TIME_BUDGET_S = 170


def plans_for(B: int, H: int, w_b: int, per_split: tuple[int, ...], sms: int, smem: int) -> dict[str, decode.Plan]:
    bt = decode.WIDE.block_t
    tiles_a, tiles_b = math.ceil(WIDTH_MAIN / bt), math.ceil(w_b / bt)
    plans = {"planner": decode.make_plan(B, H, WIDTH_MAIN, w_b, sms, smem_per_sm=smem)}
    for ps in per_split:
        plans[f"ps{ps}"] = decode.Plan(decode.WIDE, ps * bt, math.ceil(tiles_a / ps), math.ceil(tiles_b / ps))
    return plans


def _desc(p: decode.Plan) -> str:
    return f"{p.config.name} chunk={p.chunk} splits={p.splits_main}+{p.splits_extra} programs/row={p.num_splits}"


def main() -> int:
    if "--dry-run" in sys.argv:
        for kind, B, H, w_b, ps in SHAPES:
            for name, p in plans_for(B, H, w_b, ps, 132, 233472).items():
                print(kind, B, H, name, _desc(p))
        return 0

    import torch

    import v4flash_bench.attention as bench
    from v4flash_kernels.attention.reference import Case, make_inputs, sparse_mla_decode_ref, valid_tokens
    from v4flash_kernels.kit.measure import time_graph

    out_path = os.path.join(os.environ.get("OUT", "."), "plan_ab.json")
    t0 = time.time()
    rows: list[dict] = []
    for i, (kind, B, H, w_b, ps) in enumerate(SHAPES):
        case = Case(batch=B, heads=H, hole_frac=0.01, **bench.KINDS[kind])
        kw = make_inputs(case, device="cuda", seed=7100 + i)
        ref_out, ref_lse = sparse_mla_decode_ref(**kw)
        sms, smem = decode._device_info(kw["q"].device)
        row: dict = {"kind": kind, "B": B, "H": H, "tokens": valid_tokens(kw), "variants": {}}
        for name, p in plans_for(B, H, w_b, ps, sms, smem).items():
            if time.time() - t0 > TIME_BUDGET_S:
                break
            fn = bench.bind_plan(p)
            try:
                chk = bench.check_call(fn, kw, ref_out, ref_lse, poison=True)
                us = time_graph(functools.partial(fn, **kw))
                v = {"ok": chk["ok"], "rel_err": chk["rel_err"], "us": round(us, 1), "plan": _desc(p)}
            except Exception as exc:  # keep the other variants' numbers
                v = {"error": repr(exc)[:300], "plan": _desc(p)}
            row["variants"][name] = v
            print(kind, B, H, name, v.get("ok"), v.get("us"), v["plan"], v.get("error", ""), flush=True)
            with open(out_path, "w") as fh:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows + [row]},
                          fh, indent=1)
        rows.append(row)
        del kw, ref_out, ref_lse
        torch.cuda.empty_cache()
    print("done", round(time.time() - t0, 1), "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
