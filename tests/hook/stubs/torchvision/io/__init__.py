"""`torchvision.io` stand-in: see the package docstring."""

from torchvision import _unavailable


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(f"torchvision.io.{name}")
