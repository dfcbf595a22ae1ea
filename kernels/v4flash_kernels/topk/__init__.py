"""Indexer top-K transform (sm_120 drop-in for the JIT topk_transform_512): Triton kernel, host-side op, exact reference, bench."""
