"""Load the pinned upstream kernel (sglang 0.5.13.post1 `flash_mla_sm120_triton.py`) for comparison.

Upstream code is never committed here: the module is read at run time from an installed sglang,
or from the pinned wheel (`$V4FLASH_SGLANG_WHEEL`, else `.cache/wheels/sglang-0.5.13.post1-*.whl`
under the repository root), written to a temp dir (Triton needs a real source file) and imported
under a private name so it never shadows sglang's own module.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Optional

MODULE_PATH = "sglang/srt/layers/attention/flash_mla_sm120_triton.py"
WHEEL_GLOB = "sglang-0.5.13.post1-*.whl"
_cached: Optional[ModuleType] = None


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def find_wheel() -> Optional[str]:
    env = os.environ.get("V4FLASH_SGLANG_WHEEL")
    if env:
        return env
    hits = sorted(glob.glob(str(_repo_root() / ".cache" / "wheels" / WHEEL_GLOB)))
    return hits[-1] if hits else None


def upstream_source() -> tuple:
    """(source text, where it came from) of upstream's kernel file."""
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc).parent / MODULE_PATH
            if p.is_file():
                return p.read_text(), str(p)
    wheel = find_wheel()
    if wheel is None:
        raise FileNotFoundError(
            "upstream kernel not found: install sglang 0.5.13.post1 or set V4FLASH_SGLANG_WHEEL "
            f"(looked for .cache/wheels/{WHEEL_GLOB})"
        )
    with zipfile.ZipFile(wheel) as z:
        return z.read(MODULE_PATH).decode(), f"{wheel}!{MODULE_PATH}"


def load_upstream() -> ModuleType:
    """Import upstream's module from its source; its `flash_mla_sparse_decode_triton` is the baseline."""
    global _cached
    if _cached is not None:
        return _cached
    text, origin = upstream_source()
    d = tempfile.mkdtemp(prefix="v4flash-upstream-")
    path = os.path.join(d, "sglang_flash_mla_sm120_triton.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("_v4flash_upstream_flash_mla_sm120_triton", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__v4flash_origin__ = origin
    _cached = mod
    return mod
