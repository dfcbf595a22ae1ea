"""Running our kernels on a CPU under Triton's interpreter (`TRITON_INTERPRET=1`): tests and the CPU self-check.

Triton 3.6's interpreter turns scalars into 1-element numpy arrays and implements `__index__`
as `int(array)`, which numpy >= 2.4 rejects for 1-d arrays; that breaks every `range()` whose
bounds come from a loaded value (our loops are bounded by `topk_length`). `fix_index` only
changes how the *interpreter* converts such a scalar; nothing that runs on a GPU is touched.
"""

from __future__ import annotations

import os
from typing import Any


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (must be decided before triton.jit runs)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def fix_index() -> None:
    """Idempotent; a no-op when triton (or its interpreter) is missing."""
    try:
        from triton.runtime import interpreter as _i
    except Exception:  # pragma: no cover - triton missing
        return
    if getattr(_i, "_v4flash_index_patched", False):
        return
    orig = _i._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _i._patch_lang_tensor = patched
    _i._v4flash_index_patched = True
