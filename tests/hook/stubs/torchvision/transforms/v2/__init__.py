"""`torchvision.transforms.v2` stand-in: see torchvision.transforms."""

from torchvision.transforms import _Stub


def __getattr__(name: str) -> _Stub:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub(f"torchvision.transforms.v2.{name}")
