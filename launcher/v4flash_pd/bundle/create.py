"""`bundle create`: assemble a bundle in a hidden work dir, then rename it into place.

The work dir (`.DIR.partial`, next to DIR) has a fixed name so a rerun after Ctrl-C or a crash
resumes: finished model-file hashes and a finished image archive are kept in its `.state/`. Only
after MANIFEST.json and SHA256SUMS are written and synced is it renamed to DIR, so a DIR that
exists is always complete; an interrupted create leaves nothing that `verify` would accept.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from v4flash_pd import __version__
from v4flash_pd.bundle import layout, modelmanifest, sbom, signing, sums
from v4flash_pd.bundle.hashing import HashJob, hash_parallel
from v4flash_pd.bundle.image import ImageRecord, connect, image_id_of, lock_label_mismatches, save_image
from v4flash_pd.bundle.progress import Progress, human_bytes
from v4flash_pd.errors import UserError
from v4flash_pd.stacklock import StackLock, load_lock

DOWNLOAD = ":download:"  # --wheelhouse given without a directory (not a plausible dir name)


@dataclass(frozen=True)
class CreateOptions:
    out: Path
    image: str | None = None
    model: Path | None = None
    wheelhouse: Path | str | None = None  # a source dir, DOWNLOAD, or None
    engine: str | None = None
    zstd_level: int = 3
    jobs: int | None = None
    lock_path: Path | None = None
    show_progress: bool = True
    sign: Path | None = None  # OpenSSH private key (or its .pub, key in ssh-agent): sign SHA256SUMS


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())


def _check_out(out: Path) -> None:
    if out.exists():
        raise UserError(
            f"{out} already exists",
            "choose a new --out DIR (a bundle is never written over an existing directory), or remove it",
        )
    if not out.parent.is_dir():
        raise UserError(f"the parent of --out, {out.parent}, does not exist", f"create it: mkdir -p {out.parent}")


def _image(opts: CreateOptions, work: Path, state: Path, lock: StackLock, log: Callable[[str], None]) -> ImageRecord:
    assert opts.image is not None
    client = connect(opts.engine)
    archive = work / layout.IMAGE_ARCHIVE
    state_file = state / "image.json"
    current_id = image_id_of(client, opts.image)
    if current_id and state_file.is_file() and archive.is_file():
        try:
            saved = json.loads(state_file.read_text())
            same = (saved.get("id"), saved.get("ref"), saved.get("archive_size"))
            if same == (current_id, opts.image, archive.stat().st_size):
                log(f"resuming: image archive for {opts.image} ({current_id[:19]}) already saved")
                rec = saved["record"]
                return ImageRecord(rec["id"], tuple(rec["repo_tags"]), rec["tar_sha256"], rec["tar_size"], rec["labels"])
        except (ValueError, KeyError, TypeError):
            pass
    log(f"saving image {opts.image} through the engine API (zstd level {opts.zstd_level})")
    record = save_image(client, opts.image, archive, opts.zstd_level, Progress("save image", enabled=opts.show_progress))
    bad = lock_label_mismatches(record.labels, lock.sha256)
    if bad:
        raise UserError(
            f"image {opts.image} was built from a different stack lock ({', '.join(bad)}) than {lock.path} "
            f"(sha256 {lock.sha256})",
            "rebuild the image from this checkout (`make image`), or pass --lock with the lock it was built from",
        )
    state.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps({
        "ref": opts.image, "id": record.id, "archive_size": archive.stat().st_size,
        "record": {"id": record.id, "repo_tags": list(record.repo_tags), "tar_sha256": record.tar_sha256,
                   "tar_size": record.tar_size, "labels": record.labels},
    }))
    log(f"image {record.id[:19]} saved: {human_bytes(record.tar_size)} tar -> {human_bytes(archive.stat().st_size)} zstd")
    return record


def _wheelhouse(opts: CreateOptions, work: Path, lock: StackLock, log: Callable[[str], None]) -> dict[str, Any]:
    from v4flash_pd.bundle import wheelhouse

    dest = work / layout.WHEELHOUSE
    if opts.wheelhouse == DOWNLOAD:
        log(f"downloading the {len(lock.packages)} locked wheels with pip (hash-checked)")
        names = wheelhouse.download(lock, dest)
    else:
        log(f"collecting locked wheels from {opts.wheelhouse}")
        names = wheelhouse.collect_from_dir(lock, Path(opts.wheelhouse), dest)  # type: ignore[arg-type]
    return {"path": layout.WHEELHOUSE, "files": len(names)}


def _drop_model_copy(model_dir: Path, text: str, log: Callable[[str], None]) -> Path | None:
    """Best effort: put the manifest where `up`'s preflight looks (inside, else next to, the dir)."""
    for target in (model_dir / modelmanifest.IN_DIR_NAME,
                   model_dir.parent / f"{model_dir.name}{modelmanifest.SIBLING_SUFFIX}"):
        try:
            modelmanifest.write_atomic(target, text)
            return target
        except OSError:
            continue
    log(f"note: could not write a manifest copy into or next to {model_dir} (read-only); "
        "`bundle load DIR --model PATH` installs it on the far side")
    return None


def _model(opts: CreateOptions, work: Path, state: Path, log: Callable[[str], None]) -> dict[str, Any]:
    assert opts.model is not None
    model_dir = opts.model.resolve()
    progress = Progress("hash model", enabled=opts.show_progress)
    manifest, stats = modelmanifest.build_manifest(
        model_dir, state / "model-hashes.jsonl", opts.jobs, progress, log
    )
    text = manifest.to_json()
    _write(work / layout.MODEL_MANIFEST, text)
    log(
        f"model manifest: {len(manifest.files)} files, {human_bytes(manifest.total_bytes)}; hashed "
        f"{human_bytes(stats.hashed_bytes)} in {stats.seconds:.1f}s ({stats.mb_per_s:.0f} MB/s, "
        f"{stats.workers} threads), reused {human_bytes(stats.reused_bytes)} from an earlier run"
    )
    copy = _drop_model_copy(model_dir, text, log)
    if copy is not None:
        log(f"model manifest copy written to {copy}")
    return {"path": layout.MODEL_MANIFEST, "name": manifest.model_name, "files": len(manifest.files),
            "bytes": manifest.total_bytes}


def create_bundle(opts: CreateOptions, log: Callable[[str], None] = print) -> Path:
    """Build the bundle; returns its final path. Raises UserError/RuntimeFailure on problems."""
    out = opts.out.absolute()
    _check_out(out)
    lock = load_lock(opts.lock_path)
    if opts.sign is not None:
        log(f"will sign SHA256SUMS with {signing.key_fingerprint(opts.sign)}")
    work = layout.partial_dir(out)
    state = work / layout.STATE_DIR
    resumed = work.is_dir()
    work.mkdir(exist_ok=True)
    log(f"{'resuming' if resumed else 'writing'} {work} (renamed to {out} when complete)")
    created = _now()

    lock_bytes = lock.path.read_bytes()
    _write(work / layout.LOCK, lock_bytes)
    _write(work / layout.SBOM, sbom.render(sbom.sbom_from_lock(lock, created, __version__)))
    produced = {layout.LOCK, layout.SBOM}

    image_doc = None
    if opts.image:
        record = _image(opts, work, state, lock, log)
        image_doc = record.to_dict(layout.IMAGE_ARCHIVE)
        produced.add(layout.IMAGE_ARCHIVE)
    wheel_doc = None
    if opts.wheelhouse:
        wheel_doc = _wheelhouse(opts, work, lock, log)
        produced |= {f"{layout.WHEELHOUSE}/{p.name}" for p in (work / layout.WHEELHOUSE).iterdir() if p.is_file()}
    model_doc = None
    if opts.model:
        model_doc = _model(opts, work, state, log)
        produced.add(layout.MODEL_MANIFEST)

    # Anything else in the work dir is left over from an earlier, different run: drop it.
    for rel in sums.list_files(work):
        if rel not in produced and not rel.startswith(layout.STATE_DIR + "/"):
            (work / rel).unlink()

    log(f"checksumming {len(produced)} files")
    results = hash_parallel([HashJob(r, work / r, (work / r).stat().st_size) for r in produced], opts.jobs)
    files = {r: sums.FileEntry(results[r].size, results[r].sha256) for r in produced}
    manifest = sums.BundleManifest(
        created=created,
        tool_version=__version__,
        lock_sha256=lock.sha256,
        files=files,
        image=image_doc,
        model=model_doc,
        wheelhouse=wheel_doc,
        sbom={"path": layout.SBOM, "format": f"CycloneDX {sbom.SPEC_VERSION} JSON", "components": len(lock.packages)},
    )
    manifest_text = manifest.to_json()
    _write(work / layout.MANIFEST, manifest_text)
    digests = {r: e.sha256 for r, e in files.items()}
    digests[layout.MANIFEST] = hash_parallel(
        [HashJob(layout.MANIFEST, work / layout.MANIFEST, len(manifest_text))]
    )[layout.MANIFEST].sha256
    sums_text = sums.format_sums(digests)
    # Signed before the resume state is dropped: a wrong passphrase costs a rerun, not a re-hash.
    signature = signing.sign(opts.sign, sums_text.encode("utf-8")) if opts.sign is not None else None
    shutil.rmtree(state, ignore_errors=True)
    _write(work / layout.SUMS, sums_text)  # last but its signature: its presence marks completeness
    if signature is not None:
        _write(work / layout.SIGNATURE, signature)
        log(f"signed: {layout.SIGNATURE} (namespace {signing.NAMESPACE})")
    _fsync_dir(work)
    os.rename(work, out)
    _fsync_dir(out.parent)
    log(f"bundle complete: {out}")
    return out
