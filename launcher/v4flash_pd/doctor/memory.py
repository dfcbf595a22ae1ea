"""GPU memory per worker: the plan's arithmetic (weights at the worker's TP + KV pool + what stays
outside it), redone with the checkpoint's own config.json when the model directory is readable."""

from __future__ import annotations

import json
from pathlib import Path

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, warn
from v4flash_pd.memory import MemoryFit, ModelShape, refit


def checkpoint_shape(model_path: str) -> tuple[ModelShape, str]:
    """(shape, where it came from): the model's config.json, else DeepSeek-V4-Flash's published one."""
    path = Path(model_path) / "config.json" if model_path else None
    if path is None or not path.is_file():
        return ModelShape(), "DeepSeek-V4-Flash's config (no readable config.json)"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return ModelShape(), f"DeepSeek-V4-Flash's config ({path} is not readable JSON)"
    if not isinstance(data, dict):
        return ModelShape(), f"DeepSeek-V4-Flash's config ({path} is not a JSON object)"
    try:
        return ModelShape.from_config(data), f"{path}"
    except (TypeError, ValueError) as exc:
        return ModelShape(), f"DeepSeek-V4-Flash's config ({path} has unexpected fields: {exc})"


def describe(f: MemoryFit, source: str) -> str:
    card = f"{f.card_mib * 2**20 / 2**30:.1f} GiB card" + ("" if f.card_source == "topology" else " (assumed)")
    mtp = f" + MTP layer {f.mtp_gib:.1f} GiB" if f.mtp_gib else ""
    kv = f"KV pool {f.kv_gib:.1f} GiB = {f.kv_tokens:,} tokens" if f.kv_gib > 0 else "no KV pool"
    return (f"TP{f.tp}: weights {f.weights_gib:.1f} GiB{mtp}, {kv} at mem_fraction_static "
            f"{f.mem_fraction_static:.2f} of a {card}, {f.headroom_gib:.1f} GiB outside the pool "
            f"(arithmetic from {source})")


def run(inp: DoctorInput) -> list[Check]:
    shape, source = checkpoint_shape(inp.expect.model_path)
    out = []
    for planned in inp.expect.memory:
        f = refit(planned, shape) if shape != ModelShape() else planned
        row = f"memory-{f.worker}"
        if f.status == "error":
            out.append(error(row, f"{f.finding}; {describe(f, source)}", f.fix))
        elif f.status == "warn":
            out.append(warn(row, f"{f.finding}; {describe(f, source)}", f.fix))
        else:
            out.append(ok(row, describe(f, source)))
    return out
