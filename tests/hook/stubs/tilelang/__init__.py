"""Test-only stand-in for tilelang (CPU CI).

sglang 0.5.13.post1's `sglang/srt/models/deepseek_v4.py` imports `sglang/srt/layers/mhc.py` at its
top, which imports tilelang and decorates its kernels with `tilelang.jit` at import time. The hook
tests (and the hook's own status CLI, which imports every patched module) need that model module
importable on a CPU box without TileLang's CUDA toolchain. Nothing here can run a kernel: every
`tilelang.jit` kernel raises when *launched*.
"""

import enum

__version__ = "0.0.0+v4flash-test-stub"


class PassConfigKey(enum.Enum):
    TL_DISABLE_WARP_SPECIALIZED = "TL_DISABLE_WARP_SPECIALIZED"
    TL_DISABLE_TMA_LOWER = "TL_DISABLE_TMA_LOWER"
    TL_PTXAS_REGISTER_USAGE_LEVEL = "TL_PTXAS_REGISTER_USAGE_LEVEL"


class JITKernel:
    pass


def set_log_level(level):
    return None


def _unavailable(fn):
    def launch(*args, **kwargs):
        raise RuntimeError(f"tilelang stub (v4flash tests): kernel {fn.__name__} cannot run here")

    launch.__name__ = fn.__name__
    return launch


def jit(fn=None, **kwargs):
    """`@tilelang.jit` and `@tilelang.jit(...)`: the kernel raises when launched."""
    return _unavailable if fn is None else _unavailable(fn)
