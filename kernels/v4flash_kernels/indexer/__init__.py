"""Indexer logits over fp8 paged keys (sm_120 drop-in): Triton kernel, host-side op, fp64 reference.

Its bench is `v4flash_bench.indexer`.
"""
