"""Helpers for venvs that exercise the kernel hook like the image does: real wheel, .pth, sglang.

Layers (each test interpreter sees them in this order on sys.path):
1. a per-session venv's own site-packages holding *our wheel*, installed non-editable, so its
   `v4flash_kernels_hook.pth` is processed as a real site dir at interpreter start;
2. optionally an overlay (a symlinked copy of sglang with one file changed, e.g. its version);
3. the shared cached layer from tests/sglang_env.py: the pinned sglang wheel (`--no-deps`) plus
   its import-time deps, built once under `.cache/` and reused;
4. `.venv`'s site-packages (torch CPU, triton, numpy: not copied) and the torchvision stub.
Layers 2-4 are plain path entries, so only layer 1's .pth files run (not .venv's editable finder).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from sglang_env import make_venv, pip, site_dir

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
STUBS = Path(__file__).resolve().parent / "stubs"
PROBE = Path(__file__).resolve().parent / "probe.py"
LOG_PREFIX = "[v4flash-kernels]"
# What the .pth may import at interpreter start (everything else waits for SGLang's module).
BOOT_MODULES = {"v4flash_kernels", "v4flash_kernels.hook", "v4flash_kernels.hook.hook_boot"}
HEAVY = ("torch", "triton", "sglang", "numpy", "inspect", "logging", "json", "v4flash_kernels.hook.hook")


@dataclass(frozen=True)
class Run:
    rc: int
    stdout: str
    stderr: str
    result: dict | None = field(default=None)

    @property
    def hook_lines(self) -> list[str]:
        """Lines our hook logged (stderr), across the process and any children."""
        return [ln for ln in self.stderr.splitlines() if ln.startswith(LOG_PREFIX)]


def probe_run(p: subprocess.CompletedProcess) -> Run:
    """A finished probe: its last `PROBE-JSON {...}` stdout line is the result."""
    result = None
    for ln in p.stdout.splitlines():
        if ln.startswith("PROBE-JSON "):
            result = json.loads(ln[len("PROBE-JSON "):])
    return Run(p.returncode, p.stdout, p.stderr, result)


@dataclass(frozen=True)
class HookEnv:
    python: Path
    site: Path
    layers: tuple[Path, ...]

    def run(self, *args: str, env: dict | None = None, flags: tuple[str, ...] = (), timeout: int = 240,
            cwd: Path | None = None) -> Run:
        """Fresh interpreter running probe.py; V4FLASH_* from the caller's env are not inherited."""
        e = {k: v for k, v in os.environ.items() if not k.startswith(("V4FLASH_", "TRITON_", "PYTHON", "SGLANG_"))}
        e["PROBE_PATHS"] = os.pathsep.join(str(p) for p in (self.site, *self.layers))
        e.update(env or {})
        p = subprocess.run([str(self.python), *flags, str(PROBE), *args], env=e, capture_output=True,
                           text=True, timeout=timeout, cwd=str(cwd) if cwd else None)
        return probe_run(p)

    def probe_code(self, code: str, *args: str, env: dict | None = None, timeout: int = 240) -> Run:
        """Fresh interpreter running `code` (which prints one PROBE-JSON line), like `run` runs probe.py."""
        return probe_run(self.python_args("-c", code, *args, env=env, timeout=timeout))

    def python_c(self, code: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
        return self.python_args("-c", code, env=env, timeout=timeout)

    def python_args(self, *args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
        e = {k: v for k, v in os.environ.items() if not k.startswith(("V4FLASH_", "TRITON_", "PYTHON", "SGLANG_"))}
        e.update(env or {})
        return subprocess.run([str(self.python), *args], env=e, capture_output=True, text=True, timeout=timeout,
                              cwd="/")


def build_hook_env(path: Path, wheel: Path, sglang_site: Path, overlay: Path | None = None) -> HookEnv:
    layers = ([overlay] if overlay else []) + [sglang_site, Path(sysconfig.get_paths()["purelib"]), STUBS]
    py = make_venv(path, layers)
    # --ignore-installed: .venv (a plain path layer here) holds the editable v4flash-pd of the same
    # version; pip must install ours into this venv, not skip it or touch .venv.
    pip(py, "install", "-q", "--no-deps", "--ignore-installed", str(wheel))
    return HookEnv(py, site_dir(path), tuple(layers))


def sglang_overlay(dest: Path, sglang_site: Path, version: str | None = None,
                   edit: tuple[str, str, str] | None = None) -> Path:
    """A copy of the installed sglang (files symlinked) that differs in its version or one file.

    version: rename the dist-info and rewrite `sglang/_version.py`, i.e. what a different release
    installed in front of the pinned one looks like to both `importlib.metadata` and `sglang`.
    edit: (relative path, old text, new text) replaced in a real copy of that file.
    """
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(sglang_site / "sglang", dest / "sglang", copy_function=os.symlink, ignore=ignore)
    (dist,) = sglang_site.glob("sglang-*.dist-info")
    new_version = version or dist.name[len("sglang-"):-len(".dist-info")]
    new_dist = dest / f"sglang-{new_version}.dist-info"
    shutil.copytree(dist, new_dist)
    meta = (new_dist / "METADATA").read_text()
    old_version = dist.name[len("sglang-"):-len(".dist-info")]
    (new_dist / "METADATA").write_text(meta.replace(f"Version: {old_version}\n", f"Version: {new_version}\n", 1))
    if version:
        vfile = dest / "sglang" / "_version.py"
        text = vfile.read_text().replace(old_version, version)
        vfile.unlink()
        vfile.write_text(text.replace(repr(tuple(_vtuple(old_version))), repr(tuple(_vtuple(version)))))
    if edit:
        rel, old, new = edit
        f = dest / rel
        text = f.read_text()
        if old not in text:
            raise AssertionError(f"overlay edit: {old!r} not found in {rel}")
        f.unlink()
        f.write_text(text.replace(old, new, 1))
    return dest


def _vtuple(v: str) -> list:
    return [int(x) if x.isdigit() else x for x in v.split(".")]
