"""Indexer top-K transform (sm_120 drop-in for the JIT topk_transform_512): kernel, op, reference.

Its bench is `v4flash_bench.topk`.
"""
