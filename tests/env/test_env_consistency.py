"""One stack, stated consistently: stack.toml, stack.lock, pyproject's `serve` extra, the
Dockerfile and flake.nix agree, and each kind of drift is caught (mutated copies)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import check_consistency as cc

from conftest import need_tool


def _use_nix() -> bool:
    return shutil.which("nix") is not None


def test_repo_is_consistent() -> None:
    need_tool("nix")
    assert cc.all_problems(cc.ROOT, use_nix=True) == []


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"fixture drifted: {old!r} not in {path.name}"
    path.write_text(text.replace(old, new, 1))


def test_copy_is_consistent_before_mutation(stack_copy: Path) -> None:
    assert cc.all_problems(stack_copy, use_nix=_use_nix()) == []


def test_pyproject_drift_detected(stack_copy: Path) -> None:
    _edit(stack_copy / "pyproject.toml", '"torch==2.11.0"', '"torch==2.10.0"')
    problems = cc.check_pyproject(stack_copy)
    assert any("pyproject.toml" in p and "torch" in p for p in problems), problems


def test_pyproject_serve_extra_drift_detected(stack_copy: Path) -> None:
    _edit(stack_copy / "pyproject.toml", '  "torch==2.11.0",\n', '  "torch==2.10.0",\n')
    problems = cc.check_pyproject(stack_copy)
    assert any("serve extra" in p and "torch" in p for p in problems), problems


def test_pyproject_kernels_extra_drift_detected(stack_copy: Path) -> None:
    _edit(stack_copy / "pyproject.toml", '"triton==3.6.0"]', '"triton==3.8.0"]')
    problems = cc.check_pyproject(stack_copy)
    assert any("kernels extra" in p and "triton" in p and "3.8.0" in p for p in problems), problems


def test_pyproject_extra_pin_detected(stack_copy: Path) -> None:
    _edit(stack_copy / "pyproject.toml", '"sglang-router==0.3.2",', '"sglang-router==0.3.2",\n  "nixl==1.5.1",')
    assert any("nixl" in p and "not a stack.toml pin" in p for p in cc.check_pyproject(stack_copy))


def test_launcher_dependencies_are_in_the_lock(stack_copy: Path) -> None:
    """click is locked at an allowed version; tomli (Python 3.10 only) needs no entry in a 3.12 lock."""
    assert cc.check_dependencies(stack_copy) == []
    text = (stack_copy / "pyproject.toml").read_text()
    assert "\"tomli>=1.1; python_version < '3.11'\"" in text


def test_launcher_dependency_drift_detected(stack_copy: Path) -> None:
    _edit(stack_copy / "pyproject.toml", '"click>=8.1,<9"',
          '"click>=9", "nosuchpkg>=1", "tomli>=1.1; python_version >= \'3.11\'"')
    problems = cc.check_dependencies(stack_copy)
    assert any("click" in p and "stack.lock has click 8." in p for p in problems), problems
    assert any("nosuchpkg is not in stack.lock" in p for p in problems), problems
    assert any("tomli is not in stack.lock" in p for p in problems), problems  # needed on 3.12 now, and not locked


def test_stack_toml_edit_without_relock_detected(stack_copy: Path) -> None:
    _edit(stack_copy / "stack.toml", 'tilelang = "0.1.8"', 'tilelang = "0.1.9"')
    problems = cc.check_lock(stack_copy)
    assert any("tilelang" in p and "0.1.9" in p for p in problems), problems
    assert any("make lock" in p for p in problems), problems


def test_lock_version_edit_detected(stack_copy: Path) -> None:
    _edit(stack_copy / "stack.lock", "\nsglang-kernel==0.4.3 ", "\nsglang-kernel==0.4.4 ")
    problems = cc.check_lock(stack_copy)
    assert any("sglang-kernel" in p and "0.4.4" in p for p in problems), problems


def test_dockerfile_pin_drift_detected(stack_copy: Path) -> None:
    df = stack_copy / "docker/Dockerfile"
    df.write_text(df.read_text() + "\nRUN pip install --no-cache-dir sglang==0.5.12\n")
    assert any("docker/Dockerfile" in p and "sglang==0.5.12" in p for p in cc.check_dockerfile(stack_copy))


def test_dockerfile_base_must_be_digest_pinned_and_match_python(stack_copy: Path) -> None:
    df = stack_copy / "docker/Dockerfile"
    text = df.read_text()
    df.write_text(re.sub(r"^ARG BASE_IMAGE=\S+", "ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04", text, flags=re.M))
    assert any("digest" in p for p in cc.check_dockerfile(stack_copy))
    df.write_text(re.sub(r"ubuntu24\.04@", "ubuntu22.04@", text))
    assert any("python 3.10" in p for p in cc.check_dockerfile(stack_copy))


def test_dockerfile_must_install_the_lock(stack_copy: Path) -> None:
    sh = stack_copy / "docker/install-locked.sh"
    sh.write_text(sh.read_text().replace("--require-hashes", ""))
    assert any("--require-hashes" in p for p in cc.check_dockerfile(stack_copy))


def test_flake_hardcoded_pin_detected(stack_copy: Path) -> None:
    need_tool("nix")
    _edit(stack_copy / "flake.nix", "stackPins = stack.pins;", 'stackPins = stack.pins // { torch = "2.10.0"; };')
    problems = cc.check_flake(stack_copy, use_nix=True)
    assert any("flake.nix" in p and "torch" in p for p in problems), problems


def test_flake_python_drift_detected(stack_copy: Path) -> None:
    need_tool("nix")
    _edit(stack_copy / "flake.nix", "pythonVersion = stack.target.python;", 'pythonVersion = "3.11";')
    problems = cc.check_flake(stack_copy, use_nix=True)
    assert any("python 3.11" in p for p in problems), problems


def test_flake_must_read_the_lock_files(stack_copy: Path) -> None:
    _edit(stack_copy / "flake.nix", "builtins.readFile ./stack.toml", 'builtins.readFile ./pins.toml')
    assert any("must read ./stack.toml" in p for p in cc.check_flake(stack_copy, use_nix=False))


def test_flake_lock_inputs_pinned(stack_copy: Path) -> None:
    _edit(stack_copy / "flake.lock", '"narHash"', '"narHashX"')
    assert any("flake.lock" in p for p in cc.check_flake(stack_copy, use_nix=False))
