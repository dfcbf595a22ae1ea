"""Block-scaled FP8 GEMM / linear (sm_120 drop-in): Triton kernel, host-side op, fp64 reference.

Its bench is `v4flash_bench.fp8_gemm`.
"""
