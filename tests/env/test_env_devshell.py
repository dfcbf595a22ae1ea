"""The dev shell's venv (tools/devshell-venv.sh, run by flake.nix's shellHook) really comes from
stack.lock with hash checking: built once, a no-op while the lock is unchanged, never clobbering a
venv it did not make, and refusing a tampered lock. Uses the router subset (a few MB) rather than
the multi-GB GPU stack; the mechanism is the same."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, need_tool
from v4flash_pd import stacklock

pytestmark = pytest.mark.timeout(600)

TREE = ("launcher", "kernels", "tools", "pyproject.toml", "setup.py", "README.md", "stack.toml", "stack.lock")


def _tree(tmp: Path) -> Path:
    root = tmp / "src"
    for rel in TREE:
        if (ROOT / rel).is_dir():
            shutil.copytree(ROOT / rel, root / rel, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            root.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, root / rel)
    return root


def _run(root: Path, venv: Path) -> subprocess.CompletedProcess:
    uv = need_tool("uv")
    env = dict(os.environ)
    env.update(V4FLASH_ROOT=str(root), V4FLASH_VENV=str(venv), V4FLASH_PYTHON=sys.executable,
               V4FLASH_STACK_SUBSET="sglang-router click", V4FLASH_WHEELHOUSE=str(root / "no-wheelhouse"),
               PATH=f"{Path(uv).parent}:{env['PATH']}", UV_NO_MANAGED_PYTHON="1")
    return subprocess.run(["bash", str(root / "tools/devshell-venv.sh")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=540)


def test_venv_from_lock_then_noop_then_hands_off(tmp_path: Path) -> None:
    root, venv = _tree(tmp_path), tmp_path / "venv"
    first = _run(root, venv)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "materialising" in first.stderr
    lock = stacklock.load_lock(root / "stack.lock")
    assert (venv / ".v4flash-stack-lock-sha256").read_text().startswith(lock.sha256)
    ver = subprocess.run([str(venv / "bin/python"), "-c",
                          "import importlib.metadata as m; print(m.version('sglang-router'))"],
                         capture_output=True, text=True, timeout=60)
    assert ver.stdout.strip() == lock.get("sglang-router").version
    cli = subprocess.run([str(venv / "bin/v4flash-pd"), "--version"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "v4flash-pd, version" in cli.stdout

    again = _run(root, venv)
    assert again.returncode == 0 and "materialising" not in again.stderr

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep").write_text("mine")
    other = _run(root, foreign)
    assert other.returncode == 0 and "leaving it alone" in other.stderr
    assert (foreign / "keep").read_text() == "mine" and not (foreign / "bin").exists()


def test_tampered_lock_is_refused(tmp_path: Path) -> None:
    root, venv = _tree(tmp_path), tmp_path / "venv"
    lock = root / "stack.lock"
    text = lock.read_text()
    m = re.search(r"^sglang-router==0\.3\.2 \\\n((?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", text, re.M)
    assert m
    block = m.group(1)
    lock.write_text(text.replace(block, re.sub(r"sha256:([0-9a-f]{64})", lambda h: "sha256:" + h.group(1)[::-1], block)))
    proc = _run(root, venv)
    assert proc.returncode != 0
    assert "hash" in proc.stderr.lower(), proc.stderr[-2000:]
    assert not (venv / ".v4flash-stack-lock-sha256").exists()
