"""GPU builders for the ops of `model`: real TP4 shapes and formats, a reference check, a timed closure.

Each builder turns one `model.Op` and one implementation ("upstream" = the pinned sglang code
loaded from the wheel at run time, "ours" = a v4flash_kernels patch) into a `Prepared`: `run()`
does `calls` calls on inputs rotated so that streamed weights are not in L2 from the previous
call, and `check()` compares one call against a reference (fp64 torch from the format's
definition; torch for the GEMMs) and returns the relative error. Nothing here is timed; `runner`
does that under CUDA-graph replay.

An op names the registry patch that replaces it (`Op.patch`, a `PatchSpec` name); that patch's switch
names the module holding its builder (`Switch.step`), so this hub names no op: adding a kernel adds its
builder module and its registry entry. Ops no patch replaces are built by `unpatched`.
"""

from __future__ import annotations

import importlib

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import unpatched
from v4flash_bench.step.ops.common import Prepared
from v4flash_kernels.hook.patches import by_name, switch_by_name


def builder_module(patch: str) -> str:
    """The step module of the switch that turns `patch` on and off."""
    switch = switch_by_name(by_name(patch).switch)
    if switch.step is None:
        raise LookupError(f"switch {switch.name} names no step-bench builders (Switch.step)")
    return switch.step


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """Raise `common.Unavailable` when `impl` == "ours" and that patch does not exist yet."""
    if op.patch is None:
        return unpatched.build(op, impl, l2, seed)
    prepared: Prepared = importlib.import_module(builder_module(op.patch)).build(op, impl, l2, seed)
    return prepared
