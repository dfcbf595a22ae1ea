"""What every step-bench builder shares: the result types, the device, the patch lookup, inputs.

`DEVICE` is "cuda"; CPU tests set "cpu" to run the builders' checks under the Triton interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch

from v4flash_kernels.hook.patches import by_name
from v4flash_kernels.kit.compare import excess_error, rel_err

DEVICE = "cuda"
# The relative Frobenius error allowed the ops whose arithmetic chains several bf16 roundings (sparse-MLA
# attention: P and the output in bf16; MoE: the activation and the output; indexer logits: fp8 inputs;
# mHC: bf16 streams): each op folder's self-check holds the kernel to the same bound, 5-10x above what the
# kernels measure. The GEMMs and the glue are held to their own rounding bounds (`rounding_check`).
REL_TOL = 1e-2
U_BF16 = 2.0 ** -8  # round to nearest bf16: half an ulp of an 8-bit significand, relative
U_FP32 = 2.0 ** -24


def u_bf16_triton() -> float:
    """The bf16 rounding of a Triton kernel's output: to nearest on a GPU; Triton's CPU interpreter
    (TRITON_INTERPRET=1, the CPU tests) casts fp32 -> bf16 by truncation, under one ulp (2^-7)."""
    return 2.0 ** -7 if os.environ.get("TRITON_INTERPRET") == "1" else U_BF16
MAX_ROTATIONS = 16

@dataclass(frozen=True)
class Check:
    ok: bool
    rel_err: float
    detail: str = ""


@dataclass
class Prepared:
    """`run()` makes `calls` calls, one per rotated input set; `one(i)` makes call i alone (input set
    i mod `calls`), so the step graph can put one call of every op of a layer in order. Builders
    with one input set (calls = 1) leave `one` None: the call is `run()`."""

    run: Callable[[], None]
    calls: int
    check: Callable[[], Check]
    source: str
    one: Callable[[int], None] | None = None

    def call(self, i: int) -> None:
        if self.one is None:
            self.run()
        else:
            self.one(i)


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


def patch_function(patch: str) -> Tuple[Callable[..., Any] | None, str]:
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


def rounding_check(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor | None, rtol: float, atol_mag: float,
                   what: str) -> Check:
    """Every element within `rtol` |ref| + `atol_mag` `mag` (`mag`: the sum of |terms| of each element,
    None = no accumulation): the bound of the arithmetic, not of a draw; the relative error is reported."""
    bound_mag = mag if mag is not None else torch.zeros_like(ref)
    ex = excess_error(out, ref, bound_mag, rtol=rtol, atol_mag=atol_mag)
    return Check(ex <= 1.0, rel_err(out, ref), f"{what}: {ex:.2f} of the rounding bound")


def op_seed(seed: int, key: str) -> int:
    """One op's inputs' seed: from the run's seed and the op's key only, so an op draws the same inputs
    whatever else a run measures (its upstream and ours the same ones)."""
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 31)


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


def randn(shape: Any, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=DEVICE) * scale).to(dtype)
