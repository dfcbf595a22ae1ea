"""Session fixtures for the kernel-hook tests; the layering is described in hookenv.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sglang_env
from hookenv import REPO, HookEnv, build_hook_env


@pytest.fixture(scope="session")
def sglang_layer() -> Path:
    """site-packages dir with the real pinned sglang + its import-time deps (shared, cached)."""
    return sglang_env.sglang_layer()


@pytest.fixture(scope="session")
def hook_wheel(tmp_path_factory) -> Path:
    """Our v4flash-pd wheel, built from a copy of the working tree (no build/ in the checkout)."""
    src = tmp_path_factory.mktemp("wheel-src")
    for name in ("pyproject.toml", "setup.py", "README.md", "stack.lock", "stack.toml", "LICENSE"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("launcher", "kernels"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        check=True, timeout=300, stdout=subprocess.DEVNULL,
    )
    (wheel,) = dist.glob("v4flash_pd-*.whl")
    return wheel


@pytest.fixture(scope="session")
def hook_env(tmp_path_factory, hook_wheel, sglang_layer) -> HookEnv:
    """Our wheel really installed over the real pinned sglang."""
    return build_hook_env(tmp_path_factory.mktemp("hookvenv"), hook_wheel, sglang_layer)


