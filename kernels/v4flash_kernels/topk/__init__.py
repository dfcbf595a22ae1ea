"""Indexer top-K transform (sm_120 drop-in for the JIT topk_transform_512): kernel, op, reference, bench."""
