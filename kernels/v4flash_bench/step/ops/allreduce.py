"""The IPC all-reduce in the step bench: not timed on one GPU, so the step uses its labelled estimate.

A TP group's all-reduce crosses PCIe between the group's GPUs; the step bench runs on one GPU, so
neither NCCL's nor ours can be timed here, and the model carries the all-reduce as an estimate with
its source (`model.estimates`, `model.allreduce_us`). `python -m v4flash_bench.allreduce` measures
both on a box's GPUs, and `--simulate` times the protocol on one GPU (no link).
"""

from __future__ import annotations

from v4flash_bench.step import model as M
from v4flash_bench.step.ops.common import Prepared, Unavailable


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    raise Unavailable("one GPU cannot time a TP group's all-reduce over PCIe: the step uses model.estimates "
                      "(python -m v4flash_bench.allreduce measures it on the box)")
