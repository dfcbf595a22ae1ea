"""Warm calls of the shipped block-FP8 linear at one shape and row count, for Nsight Compute.

From the repo root on the GPU machine (the first calls are skipped, the next one profiled):

    PYTHONPATH=kernels ncu -k regex:gemv -s 3 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section LaunchStats --section Occupancy --section WarpStateStats \
        python kernels/scripts/ncu_fp8.py --n 1536 --k 4096 --m 1
"""

import argparse

import torch

from v4flash_kernels.fp8_gemm import op
from v4flash_kernels.kit.device import num_sms

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=1536)
ap.add_argument("--k", type=int, default=4096)
ap.add_argument("--m", type=int, default=1)
args = ap.parse_args()
dev = torch.device("cuda")
w = torch.randn((args.n, args.k), device=dev).to(torch.float8_e4m3fn)
s = torch.rand((args.n // 128, args.k // 128), device=dev) * 0.02 + 0.005
x = torch.randn((args.m, args.k), device=dev).to(torch.bfloat16)
print(op.plan(args.m, args.n, args.k, num_sms(dev)).name, flush=True)
for _ in range(5):
    op.w8a8_block_fp8_linear(x, w, [128, 128], s)
torch.cuda.synchronize()
