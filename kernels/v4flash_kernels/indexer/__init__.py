"""Indexer logits over fp8 paged keys (sm_120 drop-in): Triton kernel, host-side op, fp64 reference, bench."""
