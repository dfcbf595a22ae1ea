"""Deliberately broken kernels, to prove the self-check catches each failure class (tests only).

`V4FLASH_SELFCHECK_INJECT=PATCH:KIND[@GPU][,...]` makes the runner call a broken version of that
patch's function instead of ours (on every GPU, or only on the GPU of that physical index); the
launcher's rehearsal stand-in reads the same variable and reports the same failure without a GPU.
The failures are real where a real one can be provoked portably: `wrong` scales ours' result by
1.5 (a miscompile that computes the wrong numbers), `compile` launches a kernel whose body fails
Triton's compile-time assertion, `launch` (on a GPU) stores through an address no allocation
owns, a sticky CUDA error that loses the process's context. `resource` raises Triton's own
OutOfResources as a kernel needing more shared memory than the GPU has would (no kernel exceeds
it portably on every GPU); `hang` never returns and `crash` aborts the process, for the
launcher's watchdog. On the CPU interpreter `launch` raises the error text a GPU gives, since a
wild store would crash numpy.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Mapping

ENV = "V4FLASH_SELFCHECK_INJECT"
KINDS = ("wrong", "compile", "resource", "launch", "hang", "crash")


def parse(text: str, gpu: int | None = None) -> Dict[str, str]:
    """'moe:wrong,indexer:compile@5' -> {'moe': 'wrong', 'indexer': 'compile'} on GPU 5 (without the
    indexer item elsewhere); ValueError names the bad item. Stdlib only (the stand-in imports it)."""
    out: Dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        head, at, where = item.partition("@")
        patch, sep, kind = head.partition(":")
        patch, kind, where = patch.strip(), kind.strip(), where.strip()
        if not sep or not patch or kind not in KINDS or (at and not where.isdigit()):
            raise ValueError(f"{ENV} item {item!r} is not PATCH:KIND[@GPU] with KIND one of {', '.join(KINDS)}")
        if not at or gpu is None or int(where) == gpu:
            out[patch] = kind
    return out


def from_env(env: Mapping[str, str] | None = None, gpu: int | None = None) -> Dict[str, str]:
    return parse((os.environ if env is None else env).get(ENV, ""), gpu)


def wrap(kind: str, ours: Callable[[Any], Any], device: str) -> Callable[[Any], Any]:
    """`ours` made to fail the way `kind` says (see the module docstring)."""
    if kind == "wrong":
        def wrong(inputs: Any) -> Any:
            out = ours(inputs)
            _scale_first(out)
            return out
        return wrong

    def broken(inputs: Any) -> Any:
        _fail(kind, device)
        return ours(inputs)
    return broken


def _scale_first(out: Any) -> None:
    import torch

    t = out[0] if isinstance(out, (tuple, list)) else out
    finite = torch.isfinite(t)
    t.copy_(torch.where(finite, t * 1.5, t))


def _fail(kind: str, device: str) -> None:
    import torch

    if kind == "compile":
        x = torch.zeros(16, device=device)
        _kernels()["static_assert"][(1,)](x)
    elif kind == "resource":
        from triton.runtime.errors import OutOfResources

        raise OutOfResources(262144, 101376, "shared memory")
    elif kind == "launch":
        if not device.startswith("cuda"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected on the interpreter)")
        x = torch.zeros(16, device=device)
        _kernels()["wild_store"][(1,)](x)
        torch.cuda.synchronize()
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "crash":
        os.abort()


_CACHE: Dict[str, Any] = {}


def _kernels() -> Dict[str, Any]:
    """Built on first use: jit definitions need triton, which this module must not import at load."""
    if _CACHE:
        return _CACHE
    import triton
    import triton.language as tl

    # Triton kernels (pointer arguments are typed by Triton's specialisation, not by annotations)
    @triton.jit
    def static_assert(X):  # type: ignore[no-untyped-def]
        tl.static_assert(X.dtype.element_ty == tl.int8, "v4flash self-check: deliberately uncompilable kernel")
        tl.store(X, 1.0)

    @triton.jit
    def wild_store(X):  # type: ignore[no-untyped-def]
        tl.store(X + (1 << 40), 1.0)

    _CACHE.update(static_assert=static_assert, wild_store=wild_store)
    return _CACHE
