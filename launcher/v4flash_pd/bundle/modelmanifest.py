"""The model manifest: size and sha256 of every file under a model dir, hashed in parallel.

A truncated or half-copied shard is the classic air-gap failure, and it only shows up minutes into
weight loading. The manifest lets `bundle verify` (and `up`'s preflight) catch it first: sizes in
milliseconds, full hashes when asked. Building it is resumable: each finished file is appended to
a JSON-lines state file keyed by (path, size, mtime), so an interrupted run on a 300 GB model only
re-hashes the files that were in flight.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from v4flash_pd.bundle.contain import rel_problem
from v4flash_pd.bundle.hashing import HashJob, HashResult, default_workers, hash_parallel
from v4flash_pd.bundle.progress import Progress, human_bytes
from v4flash_pd.errors import UserError

FORMAT = "v4flash-model-manifest/1"
# The copy `up` finds inside a model dir (hidden, and never hashed itself).
IN_DIR_NAME = ".v4flash-manifest.json"
# The copy next to a read-only model dir: <parent>/<model-dir-name>.v4flash-manifest.json
SIBLING_SUFFIX = ".v4flash-manifest.json"
# Never part of a model's content: our own files and huggingface_hub's download bookkeeping.
_EXCLUDED_NAMES = {IN_DIR_NAME, IN_DIR_NAME + ".tmp"}
_EXCLUDED_PREFIXES = (".cache/huggingface/",)


@dataclass(frozen=True)
class ModelFile:
    path: str  # relative, POSIX separators
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelManifest:
    model_name: str
    created: str
    files: tuple[ModelFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def by_path(self) -> dict[str, ModelFile]:
        return {f.path: f for f in self.files}

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "model_name": self.model_name,
            "created": self.created,
            "algorithm": "sha256",
            "total_bytes": self.total_bytes,
            "file_count": len(self.files),
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }
        return json.dumps(doc, indent=1) + "\n"


@dataclass(frozen=True)
class BuildStats:
    hashed_bytes: int
    reused_bytes: int
    reused_files: int
    seconds: float
    workers: int

    @property
    def mb_per_s(self) -> float:
        return self.hashed_bytes / max(self.seconds, 1e-9) / 1e6


def parse_manifest(text: str, source: str = "model manifest") -> ModelManifest:
    """Pure parser; ValueError names what is wrong (callers wrap it with the file path)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{source} is not a {FORMAT} document")
    files = []
    try:
        for entry in doc["files"]:
            path, size, digest = str(entry["path"]), int(entry["size"]), str(entry["sha256"])
            if rel_problem(path) is not None or len(digest) != 64:
                raise ValueError(f"{source} has a bad entry {entry!r}")
            files.append(ModelFile(path, size, digest))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source} has a malformed files list ({exc})") from exc
    return ModelManifest(str(doc.get("model_name", "")), str(doc.get("created", "")), tuple(files))


def load_manifest(path: Path) -> ModelManifest:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read model manifest {path}: {exc.strerror}", "check the path") from exc
    except UnicodeDecodeError as exc:
        raise UserError(f"model manifest {path} is not UTF-8 text (corrupted?)", _REGEN_HINT) from exc
    try:
        return parse_manifest(text, str(path))
    except ValueError as exc:
        raise UserError(str(exc), _REGEN_HINT) from exc


_REGEN_HINT = (
    "copy the manifest again from the bundle (model/manifest.json), or regenerate it on the "
    "connected side with `v4flash-pd bundle create --model PATH`"
)


def excluded(rel: str) -> bool:
    return rel.split("/")[-1] in _EXCLUDED_NAMES or rel.startswith(_EXCLUDED_PREFIXES)


def scan(model_dir: Path) -> Iterator[tuple[str, Path, os.stat_result]]:
    """Every regular file (symlinks to files followed: the HF cache layout), sorted by path."""
    found = []
    for root, dirs, names in os.walk(model_dir):
        dirs.sort()
        for name in names:
            full = Path(root) / name
            rel = full.relative_to(model_dir).as_posix()
            if excluded(rel):
                continue
            try:
                st = full.stat()
            except OSError:  # dangling symlink: report it as missing content, not crash
                continue
            if full.is_file():
                found.append((rel, full, st))
    found.sort(key=lambda t: t[0])
    return iter(found)


def _load_state(state_path: Path | None, root: str) -> dict[tuple[str, int, int], str]:
    """Finished files of an earlier run on the same model dir; a torn last line is ignored."""
    done: dict[tuple[str, int, int], str] = {}
    if state_path is None or not state_path.is_file():
        return done
    for line in state_path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
            if rec.get("root") != root:
                continue
            done[(rec["path"], int(rec["size"]), int(rec["mtime_ns"]))] = str(rec["sha256"])
        except (ValueError, KeyError, TypeError):
            continue
    return done


def build_manifest(
    model_dir: Path,
    state_path: Path | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> tuple[ModelManifest, BuildStats]:
    """Hash the model dir, reusing finished files from `state_path` and appending new ones to it."""
    if not model_dir.is_dir():
        raise UserError(f"model dir {model_dir} does not exist or is not a directory", "pass --model PATH")
    entries = list(scan(model_dir))
    if not entries:
        raise UserError(f"model dir {model_dir} contains no files", "point --model at the downloaded weights")
    root = str(model_dir.resolve())
    done = _load_state(state_path, root)
    digests: dict[str, str] = {}
    jobs: list[HashJob] = []
    keys: dict[str, tuple[str, int, int]] = {}
    reused_bytes = reused_files = 0
    for rel, full, st in entries:
        key = (rel, st.st_size, st.st_mtime_ns)
        keys[rel] = key
        if key in done:
            digests[rel] = done[key]
            reused_bytes += st.st_size
            reused_files += 1
        else:
            jobs.append(HashJob(rel, full, st.st_size))
    todo = sum(j.size for j in jobs)
    if reused_files:
        log(f"resuming: {reused_files} file(s), {human_bytes(reused_bytes)} already hashed by an earlier run")
    log(f"hashing {len(jobs)} file(s), {human_bytes(todo)} under {model_dir}")
    if progress is not None:
        progress.start(todo)

    state_fh = None
    if state_path is not None:
        state_path.parent.mkdir(parents=True, exist_ok=True)
        state_fh = open(state_path, "a", encoding="utf-8")

    problems: list[str] = []

    def record(res: HashResult) -> None:
        if res.error:
            problems.append(f"{res.key}: {res.error}")
            return
        rel, size, mtime = keys[res.key]
        if res.size != size:
            problems.append(f"{res.key}: changed size while hashing ({size} -> {res.size} bytes)")
            return
        digests[res.key] = res.sha256
        if state_fh is not None:
            entry = {"root": root, "path": rel, "size": size, "mtime_ns": mtime, "sha256": res.sha256}
            state_fh.write(json.dumps(entry) + "\n")
            state_fh.flush()

    nworkers = workers or default_workers()
    t0 = time.monotonic()
    try:
        hash_parallel(jobs, workers=nworkers, progress=progress, on_done=record)
    finally:
        if state_fh is not None:
            state_fh.close()
    seconds = time.monotonic() - t0
    if progress is not None:
        progress.finish(f"({nworkers} threads)")
    if problems:
        raise UserError(
            f"could not hash the model dir {model_dir}: " + "; ".join(problems[:10]),
            "make sure nothing is writing to the model dir and the files are readable, then rerun",
        )
    files = tuple(ModelFile(rel, st.st_size, digests[rel]) for rel, _full, st in entries)
    created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    manifest = ModelManifest(model_dir.resolve().name, created, files)
    return manifest, BuildStats(todo, reused_bytes, reused_files, seconds, nworkers)


def compare_sizes(manifest: ModelManifest, observed: dict[str, int]) -> list[str]:
    """Pure: problems from the manifest vs {relative path: size on disk}."""
    problems = []
    for f in manifest.files:
        size = observed.get(f.path)
        if size is None:
            problems.append(f"{f.path}: missing (manifest lists {f.size} bytes)")
        elif size < f.size:
            problems.append(f"{f.path}: truncated: {size} bytes on disk, manifest says {f.size}")
        elif size != f.size:
            problems.append(f"{f.path}: size {size} bytes on disk, manifest says {f.size}")
    known = manifest.by_path()
    for path in sorted(set(observed) - set(known)):
        problems.append(f"{path}: not in the manifest (unexpected file)")
    return problems


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
