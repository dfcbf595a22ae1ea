"""The kernel self-check from the launcher's side: one check process per GPU of the plan, before workers start.

The launcher stays torch-free: it only starts `python -m v4flash_kernels.selfcheck` (or, in a
rehearsal, the stdlib stand-in `v4flash_pd.rehearsal.selfcheck`) in the workers' interpreter and
environment, one process per GPU in parallel, reads the JSON each writes, and decides. Modules:
`jobs` (plan -> one job per GPU, pure), `driver` (run them: timeouts, crashes, a lost CUDA
context), `result` (merge, render, the run dir's `selfcheck.json`), `gate` (what `up` does with it).
"""
