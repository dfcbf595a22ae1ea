"""Static checks CI runs on the environment builder: hadolint on the real Dockerfile, flake.nix
parses, and the flake evaluates (`nix flake check`) with nixpkgs overridden to an offline stub.
Each has a negative twin showing the check can fail."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from conftest import ROOT, need_tool

STUB = ROOT / "tests/env/fixtures/nix/stub-nixpkgs"
NIX = ["nix", "--extra-experimental-features", "nix-command flakes", "--option", "substituters", ""]


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([need_tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfile_is_hadolint_clean() -> None:
    proc = _hadolint(ROOT / "docker/Dockerfile")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text((ROOT / "docker/Dockerfile").read_text()
                   + "\nRUN apt-get install -y curl && pip install requests\n")
    proc = _hadolint(bad)
    assert proc.returncode == 1
    assert "DL3008" in proc.stdout or "DL3013" in proc.stdout, proc.stdout


def test_dockerfile_avoids_features_podman43_lacks() -> None:
    """buildah 1.28 rejects COPY --link and heredocs ; the image test builds with it."""
    code = [line for line in (ROOT / "docker/Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "--link" in line or "<<" in line]


def test_flake_parses() -> None:
    proc = subprocess.run([need_tool("nix-instantiate"), "--parse", str(ROOT / "flake.nix")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _flake_dir(tmp_path: Path) -> Path:
    """A plain-directory copy (a git checkout only exposes tracked files to flakes)."""
    flake = tmp_path / "flake"
    flake.mkdir()
    for name in ("flake.nix", "flake.lock", "stack.toml", "stack.lock", "pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, flake / name)
    for name in ("launcher", "kernels"):
        shutil.copytree(ROOT / name, flake / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return flake


def _nix(flake: Path, *args: str) -> subprocess.CompletedProcess:
    need_tool("nix")
    return subprocess.run([*NIX, *args, "--no-write-lock-file", "--override-input", "nixpkgs", f"path:{STUB}"],
                          cwd=flake, capture_output=True, text=True, timeout=120)


def test_flake_check_with_stub_inputs(tmp_path: Path) -> None:
    flake = _flake_dir(tmp_path)
    proc = _nix(flake, "flake", "check")
    assert proc.returncode == 0, proc.stderr
    shell = _nix(flake, "eval", "--raw", ".#devShells.x86_64-linux.default.shellHook")
    assert shell.returncode == 0, shell.stderr
    assert "tools/devshell-venv.sh" in shell.stdout and "python3.12" in shell.stdout, shell.stdout
    script = (ROOT / "tools/devshell-venv.sh").read_text()
    assert "--require-hashes" in script and "stack.lock" in script and "--no-index" in script
    app = _nix(flake, "eval", "--raw", ".#apps.x86_64-linux.default.program")
    assert app.returncode == 0 and app.stdout.endswith("/bin/v4flash-pd"), app.stderr
    pkgs = _nix(flake, "eval", "--json", ".#devShells.x86_64-linux.default.packages")
    assert pkgs.returncode == 0, pkgs.stderr
    for tool in ("python3.12", "uv", "numactl", "hadolint", "podman", "zstd"):
        assert tool in pkgs.stdout, (tool, pkgs.stdout)


def test_flake_check_fails_on_an_evaluation_error(tmp_path: Path) -> None:
    flake = _flake_dir(tmp_path)
    text = (flake / "flake.nix").read_text()
    (flake / "flake.nix").write_text(text.replace("pkgs.zstd", "pkgs.zstdNotAPackage"))
    proc = _nix(flake, "flake", "check")
    assert proc.returncode != 0
    assert "zstdNotAPackage" in proc.stderr
