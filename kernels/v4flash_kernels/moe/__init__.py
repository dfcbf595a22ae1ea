"""Routed MXFP4 experts (sm_120 drop-in): Triton kernels, host-side op, fp64 reference.

Its bench is `v4flash_bench.moe`.
"""
