"""`torchvision.transforms` stand-in (transformers' image utils import names from it at module top;
the parser test never transforms an image). Attribute access works, calls raise."""


class _Stub:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Stub":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stub (v4flash tests): {self._name} is not available")


def __getattr__(name: str) -> _Stub:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub(f"torchvision.transforms.{name}")
