"""GPU self-check of every kernel patch, run before SGLang workers start (`python -m v4flash_kernels.selfcheck`).

Every patch was checked and timed on an H200 and cross-compiled for sm_120, but Triton's code
generation differs per GPU (no wgmma/TMA on sm_120, other shared-memory limits, other MMA paths):
a kernel right on one GPU can be wrong, or not launch, on another. So before a worker loads its
weights, each GPU of the plan runs each switched-on patch here (one process per GPU) against its
fp64 reference and against upstream's function, and the launcher switches off whatever fails.

The protocol an op implements (one `selfcheck.py` in its folder, named by its switch's `selfcheck`
field in `hook/patches.py`): `cases(target: Target) -> list[Case]` (see `case.py`). A switch is the
unit checked and turned off, since that is what the launcher can turn off.
The runner (`runner.py`) runs them, turns every failure into one of a few classes (`errors.py`)
and writes the per-GPU JSON record (`record.py`). Importing this package is cheap (no torch).
"""
