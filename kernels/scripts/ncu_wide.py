"""Three warm calls of the shipped decode at c4 B=64 x 64 heads, for Nsight Compute to profile.

Used for the profile in kernels/BENCH.md (H200, 2026-11-29), from the repo root on the GPU machine:

    PYTHONPATH=kernels ncu -k regex:split_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section LaunchStats python kernels/scripts/ncu_wide.py
    PYTHONPATH=kernels ncu -k regex:split_kernel -s 2 -c 1 --metrics \
        'gpu__time_duration.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio' \
        python kernels/scripts/ncu_wide.py
    M=smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__inst_executed_op_global_ld.sum
    M=$M,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_shared_ld.sum
    PYTHONPATH=kernels ncu -k regex:split_kernel -s 2 -c 1 --section InstructionStats --metrics $M \
        python kernels/scripts/ncu_wide.py
"""

import torch

import v4flash_bench.attention as bench
from v4flash_kernels.attention import op as decode
from v4flash_kernels.attention.reference import Case, make_inputs

kw = make_inputs(Case(batch=64, heads=64, hole_frac=0.01, **bench.KINDS["c4"]), device="cuda", seed=1)


def call():
    return decode.sparse_mla_decode(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"], 512,
                                    kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices"),
                                    kw.get("extra_topk_length"))


for _ in range(3):
    call()
torch.cuda.synchronize()
