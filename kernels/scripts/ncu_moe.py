"""Warm calls of the MoE at one size and plan, for Nsight Compute to profile the two GEMMs.

From the repo root on the GPU machine (the first call's GEMMs are skipped, the next two profiled):

    PYTHONPATH=kernels ncu -k regex:gemm_kernel -s 2 -c 2 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
        python kernels/scripts/ncu_moe.py --tokens 1 [--plan inline|sorted]
"""

import argparse

import torch

from v4flash_bench.moe import EXPERTS, HIDDEN, TOPK, Shape, build_calls, build_weights, v1_fn
from v4flash_kernels.moe import op as moe

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=1)
ap.add_argument("--tp", type=int, default=4)
ap.add_argument("--plan", choices=("auto", "inline", "sorted"), default="auto")
args = ap.parse_args()
kw = build_calls(Shape(args.tp, args.tokens), build_weights(args.tp, 1, 1), 1)[0]
plan = moe.make_plan(args.tokens, TOPK, EXPERTS, HIDDEN, kw["intermediate_size"])
if args.plan != "auto":
    plan = moe.Plan(args.plan == "inline", plan.gemm1, plan.gemm2)
print(plan.name, flush=True)
fn = v1_fn(plan)
for _ in range(3):
    fn(**kw)
torch.cuda.synchronize()
