"""The bundle's wheelhouse: every locked distribution as a file whose sha256 the lock allows.

With it the far side can rebuild the image or a bare-metal venv with
`pip install --no-index --find-links wheelhouse --require-hashes -r stack.lock`. Files are matched
to the lock by hash, never by name, so a renamed or rebuilt wheel cannot slip in.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from v4flash_pd.bundle.hashing import HashJob, hash_parallel
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.stacklock import LockedPackage, StackLock

DIST_SUFFIXES = (".whl", ".tar.gz", ".zip")


def lock_index(lock: StackLock) -> dict[str, LockedPackage]:
    """{sha256 hex: package} over every hash the lock allows."""
    out = {}
    for pkg in lock.packages:
        for h in pkg.hashes:
            if h.startswith("sha256:"):
                out[h.split(":", 1)[1]] = pkg
    return out


def check_wheels(lock: StackLock, digests: dict[str, str]) -> list[str]:
    """Pure: {file name: sha256} vs the lock. Unknown files and unmarked packages with no file."""
    index = lock_index(lock)
    problems = []
    covered = set()
    for name, digest in sorted(digests.items()):
        pkg = index.get(digest)
        if pkg is None:
            problems.append(f"{name}: sha256 is not in stack.lock (not a locked artifact)")
        else:
            covered.add(pkg.name)
    for pkg in lock.packages:
        if pkg.name not in covered and not pkg.marker:
            problems.append(f"{pkg.requirement}: no wheel for it in the wheelhouse")
    return problems


def _dists(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(DIST_SUFFIXES))


def collect_from_dir(lock: StackLock, src: Path, dest: Path) -> list[str]:
    """Copy, from `src`, one file per locked package whose hash the lock allows."""
    if not src.is_dir():
        raise UserError(f"wheelhouse source {src} is not a directory", "pass --wheelhouse DIR of downloaded wheels")
    files = _dists(src)
    results = hash_parallel([HashJob(p.name, p, p.stat().st_size) for p in files])
    index = lock_index(lock)
    chosen: dict[str, Path] = {}
    for p in files:
        pkg = index.get(results[p.name].sha256)
        if pkg is not None:
            chosen.setdefault(pkg.name, p)
    missing = [pkg.requirement for pkg in lock.packages if pkg.name not in chosen and not pkg.marker]
    if missing:
        raise UserError(
            f"{src} has no file with a locked sha256 for: {', '.join(missing[:20])}"
            + (f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""),
            f"download them with `pip download --require-hashes --no-deps -r {lock.path} -d {src}` "
            "(or use --wheelhouse without a value to let bundle create download them)",
        )
    dest.mkdir(parents=True, exist_ok=True)
    for p in chosen.values():
        target = dest / p.name
        if not (target.is_file() and target.stat().st_size == p.stat().st_size):
            shutil.copy2(p, target)
    return sorted(p.name for p in chosen.values())


def download(lock: StackLock, dest: Path) -> list[str]:
    """`pip download` every locked wheel for the lock's target python/platform, hash-checked."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
           "--only-binary", ":all:", "-r", str(lock.path), "-d", str(dest)]
    if lock.header.get("python"):
        cmd += ["--python-version", lock.header["python"]]
    if lock.header.get("platform"):
        cmd += ["--platform", lock.header["platform"]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeFailure(
            "pip download of the locked wheels failed: " + " | ".join(tail),
            "check network access to the index (PIP_INDEX_URL), or pre-download the wheels and pass "
            "--wheelhouse DIR",
        )
    return sorted(p.name for p in _dists(dest))
