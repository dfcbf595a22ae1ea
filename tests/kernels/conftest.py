"""Kernel test setup: interpreter compatibility shim and the `gpu` marker's skip logic.

Triton 3.6's interpreter turns scalars into 1-element numpy arrays and implements `__index__`
as `int(array)`, which numpy >= 2.4 rejects for 1-d arrays; that breaks every `range()` whose
bounds come from a loaded value (our loops are bounded by `topk_length`). The shim below only
changes how the *interpreter* converts such a scalar; nothing that runs on a GPU is touched.
"""

from __future__ import annotations

import os

import pytest


def _patch_interpreter_index() -> None:
    try:
        from triton.runtime import interpreter as _i
    except Exception:  # pragma: no cover - triton missing
        return
    if getattr(_i, "_v4flash_index_patched", False):
        return
    orig = _i._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _i._patch_lang_tensor = patched
    _i._v4flash_index_patched = True


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


HAS_CUDA = _has_cuda()
# Without a GPU the kernel tests run under Triton's interpreter; it must be chosen before the
# kernel module is imported (triton.jit reads it at decoration time).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_index()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and "kernels" in str(item.fspath):
            item.add_marker(skip)
