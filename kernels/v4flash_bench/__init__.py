"""What measures the kernels and does not serve: the per-op benches, the decode-step bench, sweeps.

Shipped in the wheel beside `v4flash_kernels` (so `v4flash-pd bench --step` runs in the image) as its
own top-level package: the hook, the ops and the self-check never import it (a test checks that).
Run from the repository with `PYTHONPATH=kernels python -m v4flash_bench.<bench>`, or from an install
with `python -m v4flash_bench.<bench>`: `step` (one decode step op by op), `attention`, `indexer`, `moe`,
`topk`, `mhc`, `fp8_gemm` (with `fp8_sweep` over `fp8_candidates`), `allreduce`.
"""
