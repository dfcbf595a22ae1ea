"""Block-scaled FP8 GEMM / linear (sm_120 drop-in): Triton kernel, host-side op, fp64 reference, bench."""
