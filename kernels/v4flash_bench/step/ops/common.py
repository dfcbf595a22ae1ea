"""What every step-bench builder shares: the result types, the device, the patch lookup, inputs.

`DEVICE` is "cuda"; CPU tests set "cpu" to run the builders' checks under the Triton interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

from v4flash_kernels.hook.patches import by_name

DEVICE = "cuda"
REL_TOL = 1e-2
MAX_ROTATIONS = 16

@dataclass(frozen=True)
class Check:
    ok: bool
    rel_err: float
    detail: str = ""


@dataclass
class Prepared:
    run: Callable[[], None]
    calls: int
    check: Callable[[], Check]
    source: str


class Unavailable(Exception):
    """This implementation of the op does not exist here (e.g. a patch not written yet)."""


def int_param(p: Dict[str, object], key: str, default: int | None = None) -> int:
    """An integer shape parameter of a `model.Op` (whose params hold mixed types): checked, not cast."""
    v = p[key] if default is None else p.get(key, default)
    if not isinstance(v, int):
        raise TypeError(f"op parameter {key!r} must be an int, got {type(v).__name__} {v!r}")
    return int(v)


# Upstream modules loaded from the wheel, by name, once per process.
loaded: Dict[str, object] = {}


def patch_function(patch: str) -> Tuple[Callable | None, str]:
    """(our function of the registry's patch `patch`, or None, why): None with "no patch yet" when
    its module does not exist."""
    spec = by_name(patch)
    mod_name, attr = spec.ours_module, spec.ours_attr
    try:
        found = importlib.util.find_spec(mod_name) is not None
    except ModuleNotFoundError:  # the parent package is missing too
        found = False
    if not found:
        return None, "no patch yet"
    try:
        mod = importlib.import_module(mod_name)
    except Exception as exc:  # a patch that exists but does not import is reported, not hidden
        return None, f"patch import failed: {type(exc).__name__}: {exc}"
    fn = getattr(mod, attr, None)
    if fn is None:
        return None, f"no patch yet ({mod_name} has no {attr})"
    return fn, f"ours: {mod_name}.{attr}"


def check_of(err: float, detail: str = "", tol: float = REL_TOL) -> Check:
    return Check(ok=err == err and err <= tol, rel_err=err, detail=detail)


def rotations(bytes_per_call: int, l2_bytes: int) -> int:
    """Calls per timed replay, each on its own copy of the streamed operand, so that together they
    exceed 3x the L2 (a real step streams each layer's weights once)."""
    if bytes_per_call <= 0:
        return 1
    return max(1, min(MAX_ROTATIONS, math.ceil(3 * l2_bytes / bytes_per_call)))


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(shape, gen, dtype=torch.bfloat16, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=DEVICE) * scale).to(dtype)
