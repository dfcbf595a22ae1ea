"""The model check `up` (and `doctor`) run before starting workers.

Where a manifest lives, relative to a model dir MODEL (first hit wins):
  1. $V4FLASH_MODEL_MANIFEST, if set (a file path);
  2. MODEL/.v4flash-manifest.json   (written by `bundle create --model` and `bundle load --model`);
  3. MODEL/../<MODEL name>.v4flash-manifest.json   (next to a model dir that was read-only).
The default check only stats files (milliseconds even for 300 GB), which catches the classic
air-gap failure, a truncated shard; `full=True` re-hashes everything on all cores.
"""

from __future__ import annotations

import os
from pathlib import Path

from v4flash_pd.bundle.hashing import HashJob, hash_parallel
from v4flash_pd.bundle.modelmanifest import (
    IN_DIR_NAME,
    SIBLING_SUFFIX,
    ModelManifest,
    compare_sizes,
    load_manifest,
    scan,
)
from v4flash_pd.bundle.progress import Progress

MANIFEST_ENV = "V4FLASH_MODEL_MANIFEST"


def manifest_locations(model_dir: Path) -> list[Path]:
    """Candidate paths in lookup order (for messages that say where we looked)."""
    out = []
    env = os.environ.get(MANIFEST_ENV)
    if env:
        out.append(Path(env))
    out.append(model_dir / IN_DIR_NAME)
    out.append(model_dir.parent / f"{model_dir.name}{SIBLING_SUFFIX}")
    return out


def find_manifest(model_dir: Path) -> Path | None:
    """The manifest for `model_dir`, or None when there is none (then `up` skips the check)."""
    for cand in manifest_locations(Path(model_dir)):
        if cand.is_file():
            return cand
    return None


def check_against(
    manifest: ModelManifest, model_dir: Path, full: bool = False, progress: Progress | None = None
) -> list[str]:
    """Problems (empty = ok): missing/truncated/extra files; with `full`, sha256 mismatches too."""
    if not model_dir.is_dir():
        return [f"{model_dir}: model dir does not exist"]
    observed = {rel: st.st_size for rel, _full, st in scan(model_dir)}
    problems = compare_sizes(manifest, observed)
    if not full:
        return problems
    size_bad = {p.split(":", 1)[0] for p in problems}
    jobs = [
        HashJob(f.path, model_dir / f.path, f.size)
        for f in manifest.files
        if f.path not in size_bad
    ]
    if progress is not None:
        progress.start(sum(j.size for j in jobs))
    results = hash_parallel(jobs, progress=progress)
    if progress is not None:
        progress.finish()
    for f in manifest.files:
        res = results.get(f.path)
        if res is None:
            continue
        if res.error:
            problems.append(f"{f.path}: cannot read: {res.error}")
        elif res.sha256 != f.sha256:
            problems.append(f"{f.path}: sha256 mismatch (content differs from the manifest)")
    return problems


def check_model_against_manifest(
    model_dir: Path, full: bool = False, progress: Progress | None = None
) -> list[str]:
    """Check `model_dir` against its manifest (see the module docstring for where it is found).

    Returns human-readable problems, each starting with the relative file name; empty means ok.
    No manifest found is itself a problem (callers that want "check only if present" call
    `find_manifest` first). A manifest that cannot be read raises UserError.
    """
    model_dir = Path(model_dir)
    path = find_manifest(model_dir)
    if path is None:
        where = ", ".join(str(p) for p in manifest_locations(model_dir))
        return [f"no model manifest found (looked at {where})"]
    return check_against(load_manifest(path), model_dir, full=full, progress=progress)
