"""The real pinned sglang wheel, importable on a CPU machine, built once and cached under .cache/.

A venv without pip whose site dir holds `sglang==0.5.13.post1` (--no-deps) plus the few modules it
imports at module top (tests/requirements-sglang.txt), layered over .venv's site-packages (torch CPU,
triton, numpy) and a torchvision stub (PyPI's torchvision is a CUDA build that cannot load next to CPU
torch). Used by the hook tests and by the launcher's parser test.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
STUBS = REPO / "tests" / "hook" / "stubs"
REQS = REPO / "tests" / "requirements-sglang.txt"
REQS_SERVER = REPO / "tests" / "requirements-sglang-server.txt"
PY_TAG = f"python{sys.version_info.major}.{sys.version_info.minor}"
SGLANG_PIN = "sglang==0.5.13.post1"


def site_dir(venv: Path) -> Path:
    return venv / "lib" / PY_TAG / "site-packages"


def pip(python: Path, *args: str, timeout: int = 600) -> None:
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", *args]
    subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL)


def make_venv(path: Path, layers: list[Path]) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    (site_dir(path) / "zz_v4flash_test_layers.pth").write_text("".join(f"{p}\n" for p in layers))
    return path / "bin" / "python"


def sglang_wheel() -> Path:
    """The pinned wheel from PyPI (`make venv` downloads it; fetched here if missing)."""
    (CACHE / "wheels").mkdir(parents=True, exist_ok=True)
    # `make test` runs three pytest processes at once: one downloads, the others wait for the whole file
    with open(CACHE / "wheels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(glob.glob(str(CACHE / "wheels" / "sglang-0.5.13.post1-*.whl")))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", str(CACHE / "wheels"), SGLANG_PIN], check=True, timeout=600)
            found = sorted(glob.glob(str(CACHE / "wheels" / "sglang-0.5.13.post1-*.whl")))
    return Path(found[-1])


def sglang_layer() -> Path:
    """site-packages dir with the real pinned sglang + its import-time deps; cached by content key."""
    wheel = sglang_wheel()
    venv_site = Path(sysconfig.get_paths()["purelib"])
    key_src = "\n".join([REQS.read_text(), REQS_SERVER.read_text(), wheel.name, str(wheel.stat().st_size), sys.version,
                         str(venv_site)])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:12]
    root = CACHE / f"hook-sglang-{key}"
    stamp = root / ".complete"
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / "hook-sglang.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            import shutil

            shutil.rmtree(root, ignore_errors=True)
            py = make_venv(root, [venv_site, STUBS])
            pip(py, "install", "-q", "--no-deps", str(wheel))
            pip(py, "install", "-q", "-r", str(REQS), "-r", str(REQS_SERVER))
            stamp.write_text(key_src)
    return site_dir(root)


def sglang_python() -> Path:
    """An interpreter that imports the real pinned sglang (no hook .pth: that is the hook tests' job)."""
    return sglang_layer().parents[2] / "bin" / "python"
