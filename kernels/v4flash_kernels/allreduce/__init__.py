"""All-reduce over CUDA IPC peer memory (one-/two-shot, 2-8 ranks): kernels, plan, communicator, drop-in.

Its bench is `v4flash_bench.allreduce`.
"""
