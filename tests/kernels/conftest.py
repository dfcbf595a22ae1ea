"""Kernel test setup: the interpreter without a GPU (with its numpy >= 2.4 shim,
`v4flash_kernels.interpreter.fix_index`) and the `gpu` marker's skip logic."""

from __future__ import annotations

import os

import pytest


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
    from v4flash_kernels.interpreter import fix_index

    fix_index()


# Upstream's files (signatures, the wheel's own functions, the verify capture list) are read from the
# pinned wheel at run time: fetch it before collecting, not whenever an earlier test happened to.
if not os.environ.get("V4FLASH_SGLANG_WHEEL"):
    from sglang_env import sglang_wheel

    sglang_wheel()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and "kernels" in str(item.fspath):
            item.add_marker(skip)
