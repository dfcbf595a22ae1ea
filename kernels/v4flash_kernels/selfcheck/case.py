"""The self-check protocol: what a case is, and the target (GPU and production facts) it is built for.

An op's `selfcheck.py` exposes `cases(target) -> list[Case]`. A case draws its inputs on the
target device from a seed (the same seed gives the same inputs, so a CUDA graph can be replayed
on fresh data copied into the captured buffers), calls ours exactly as SGLang does once the
patch is installed, and says how to compare the result with an fp64 reference written from the
format's definition. The runner owns everything else: timing, CUDA graphs, upstream, failures.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Protocol, Tuple

Inputs = Dict[str, Any]

SMALL, PRODUCTION = "small", "production"


@dataclass(frozen=True)
class Target:
    """Where the check runs and the production facts its shapes come from (all from the launcher's plan).

    `batches`: decode batch sizes checked at production shapes (B=1 and the largest captured batch);
    `prefill_rows`: rows of one extend chunk on a prefill (or aggregated) worker, 0 = none;
    `context`: `--context-length` (page-table widths); `tp_size`/`tp_rank`: this GPU's place in its
    worker (which attention heads it computes); `small_only`: the interpreter (CPU) runs only the
    small shapes. `verify_rows`: the rows of the speculative verify batches the worker captures
    (B x (k+1) with MTP on; empty without). `group`: the file store where the GPUs of this worker
    meet for the checks that span them (the all-reduce), "" = none; `shared_gpu`: the group's ranks
    share one GPU (the one-GPU test of the all-reduce's process path).
    """

    device: str = "cuda"
    batches: Tuple[int, ...] = (1,)
    prefill_rows: int = 0
    context: int = 131072
    tp_size: int = 4
    tp_rank: int = 0
    small_only: bool = False
    seed: int = 0
    verify_rows: Tuple[int, ...] = ()
    group: str = ""
    shared_gpu: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def decode_rows(self) -> Tuple[int, ...]:
        """Row counts of the decode-side calls: each decode batch and each speculative verify batch
        (B x (k+1) rows, independent rows to every op, so the same cases at those counts)."""
        return tuple(sorted({*self.batches, *self.verify_rows}))


@dataclass(frozen=True)
class Comparison:
    """Verdict of one output against its reference: `metrics` for the record, `why` when not ok."""

    ok: bool
    metrics: Mapping[str, Any] = field(default_factory=dict)
    why: str = ""


@dataclass(frozen=True)
class Case:
    """One call of one patch: ours vs the fp64 reference (and upstream's function where affordable).

    `ours(inputs)` must call the function the hook installs, the way SGLang calls it. `reference`
    and `compare` may look at a subset of rows (big production shapes); `compare(out, ref, inputs)`
    also gets the inputs so it can slice. `upstream` is None where upstream is too slow or absent,
    with `upstream_skip` saying why. `graph`: also capture ours in a CUDA graph and replay it on
    fresh inputs (GPU only).
    """

    name: str
    size: str
    make_inputs: Callable[[int], Inputs]
    ours: Callable[[Inputs], Any]
    reference: Callable[[Inputs], Any]
    compare: Callable[[Any, Any, Inputs], Comparison]
    upstream: Callable[[Inputs], Any] | None = None
    upstream_skip: str = ""
    graph: bool = False


class SelfCheckModule(Protocol):
    def cases(self, target: Target) -> List[Case]: ...


def registry_function(patch: str) -> Callable[..., Any]:
    """Ours as the registry's patch entry names it (before any adapter): the self-check tests what the
    hook installs."""
    from v4flash_kernels.hook.patches import by_name

    spec = by_name(patch)
    fn: Callable[..., Any] = getattr(importlib.import_module(spec.ours_module), spec.ours_attr)
    return fn


def check_rows(batch: int, limit: int = 24) -> List[int]:
    """Rows compared with the fp64 reference: all of a small batch, else the first three, the last
    and evenly spaced ones in between (the reference of a whole 8K-row prefill chunk would not fit)."""
    if batch <= limit:
        return list(range(batch))
    picked = {0, 1, 2, batch - 1}
    step = max(1, batch // (limit - len(picked)))
    picked.update(range(step // 2, batch, step))
    return sorted(picked)[:limit]
