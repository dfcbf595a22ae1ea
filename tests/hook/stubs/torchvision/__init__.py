"""Test-only stand-in for torchvision (CPU CI).

PyPI's torchvision wheels are CUDA builds whose `_C.so` fails to load next to the CPU torch the
CI uses (`operator torchvision::nms does not exist`), yet sglang 0.5.13.post1's
`sglang/srt/utils/common.py` does `from torchvision.io import decode_jpeg` at import time. The hook
tests never decode images, so anything reached through this stub raises when *called*.
"""

__version__ = "0.0.0+v4flash-test-stub"


def _unavailable(name: str):
    def fn(*args, **kwargs):
        raise RuntimeError(f"torchvision stub (v4flash tests): {name} is not available")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(f"torchvision.{name}")
