"""All-reduce over CUDA IPC peer memory (one-/two-shot, 2-8 ranks): kernels, plan, communicator, drop-in, bench."""
