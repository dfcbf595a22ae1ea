"""The seam between doctor's pure checks and the machine.

Every side effect a check needs (running a tool, finding it on PATH, binding a port, statting a
file system, asking importlib about a package) goes through a `Probe`. The real one reads the
environment it is given, so tests drive the *real* code paths with fixture trees, fake tools on
PATH and env overrides, and no check reads os.environ behind the probe's back.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from v4flash_pd import ports as _ports


@dataclass(frozen=True)
class CmdResult:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return (self.err or self.out).strip()


@dataclass(frozen=True)
class Probe:
    env: Mapping[str, str]
    run: Callable[..., CmdResult]  # run(argv, timeout=30.0, extra_env=None)
    which: Callable[[str], str | None]
    port_problem: Callable[[str, int], str]  # '' = free; else "already in use", "permission denied ..."
    disk_free: Callable[[str], tuple[str, int, int] | None]  # (existing path checked, free, total) bytes
    dist_version: Callable[[str], str | None]
    has_module: Callable[[str], bool]
    module_dirs: Callable[[str], tuple[str, ...]]  # where a package lives on disk (no import)


def _run(env: Mapping[str, str]) -> Callable[..., CmdResult]:
    def run(argv: Sequence[str], timeout: float = 30.0, extra_env: Mapping[str, str] | None = None) -> CmdResult:
        try:
            p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                               env={**env, **(extra_env or {})})
        except FileNotFoundError as exc:
            return CmdResult(127, "", f"{exc}")
        except PermissionError as exc:
            return CmdResult(126, "", f"{exc}")
        except subprocess.TimeoutExpired:
            return CmdResult(124, "", f"timed out after {timeout:.0f}s: {' '.join(argv)}")
        return CmdResult(p.returncode, p.stdout, p.stderr)

    return run


def _disk_free(path: str) -> tuple[str, int, int] | None:
    """Free space of the file system that will hold `path`: the nearest existing ancestor."""
    p = Path(path).expanduser()
    for cand in (p, *p.parents):
        if cand.exists():
            try:
                u = shutil.disk_usage(cand)
            except OSError:
                return None
            return str(cand), u.free, u.total
    return None


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _module_dirs(name: str) -> tuple[str, ...]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ()
    if spec is None:
        return ()
    if spec.submodule_search_locations:
        return tuple(str(p) for p in spec.submodule_search_locations)
    return (str(Path(spec.origin).parent),) if spec.origin else ()


def system_probe(env: Mapping[str, str] | None = None) -> Probe:
    env = dict(os.environ if env is None else env)
    path = env.get("PATH", os.defpath)
    return Probe(
        env=env,
        run=_run(env),
        which=lambda name: shutil.which(name, path=path),
        port_problem=lambda host, port: _ports.port_problem(host or "0.0.0.0", port),
        disk_free=_disk_free,
        dist_version=_dist_version,
        has_module=_has_module,
        module_dirs=_module_dirs,
    )
