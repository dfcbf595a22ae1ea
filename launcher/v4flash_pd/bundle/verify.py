"""`bundle verify`: prove a copied bundle is exactly what `create` wrote, offline.

Order matters for the messages: first the file set (missing / unexpected files), then every
checksum (in parallel), then the cross-checks that need intact files (MANIFEST.json vs
SHA256SUMS, lock hash, SBOM vs lock, image archive read end to end, wheelhouse vs lock), then the
model dir against the bundled model manifest. Every failing row names the file it is about.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from v4flash_pd.bundle import layout, modelmanifest, sbom, sums
from v4flash_pd.bundle.hashing import HashJob, hash_parallel
from v4flash_pd.bundle.progress import Progress, human_bytes
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.stacklock import StackLock, load_lock


@dataclass(frozen=True)
class Check:
    subject: str  # the file (or area) the row is about
    what: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class VerifyReport:
    bundle: Path
    checks: tuple[Check, ...]
    manifest: sums.BundleManifest | None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)


def render_table(report: VerifyReport) -> str:
    rows = [("", "check", "file", "detail")] + [
        ("ok" if c.ok else "FAIL", c.what, c.subject, c.detail) for c in report.checks
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows]
    return "\n".join(lines)


def raise_if_failed(report: VerifyReport, loading: bool = False) -> None:
    if report.ok:
        return
    named = "; ".join(f"{c.subject}: {c.detail or c.what}" for c in report.failures[:12])
    more = f" (and {len(report.failures) - 12} more)" if len(report.failures) > 12 else ""
    raise RuntimeFailure(
        f"bundle {report.bundle} failed verification: {named}{more}",
        "copy the named files again from the connected side (compare with `sha256sum -c SHA256SUMS` "
        "there), or recreate the bundle with `v4flash-pd bundle create`"
        + ("; nothing was loaded into the engine" if loading else ""),
    )


def _check_dir(bundle: Path) -> None:
    if bundle.is_dir():
        return
    partial = layout.partial_dir(bundle)
    if partial.is_dir():
        raise UserError(
            f"{bundle} does not exist, but {partial} does: the `bundle create` that wrote it was interrupted",
            "rerun the same `v4flash-pd bundle create --out ...` command on the connected side; it resumes",
        )
    raise UserError(f"bundle dir {bundle} does not exist", "pass the directory `bundle create --out` wrote")


def verify_bundle(
    bundle: Path,
    model: Path | None = None,
    full: bool = False,
    jobs: int | None = None,
    show_progress: bool = True,
    log: Callable[[str], None] = lambda _m: None,
) -> VerifyReport:
    bundle = Path(bundle)
    _check_dir(bundle)
    checks: list[Check] = []

    def done() -> VerifyReport:
        return VerifyReport(bundle, tuple(checks), manifest)

    manifest: sums.BundleManifest | None = None
    sums_path = bundle / layout.SUMS
    try:
        listed = sums.parse_sums(sums_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        checks.append(Check(layout.SUMS, "present", False, "missing (not a complete bundle)"))
        return done()
    except (ValueError, UnicodeDecodeError) as exc:
        checks.append(Check(layout.SUMS, "parse", False, f"damaged: {exc}"))
        return done()
    checks.append(Check(layout.SUMS, "parse", True, f"{len(listed)} entries"))

    # MANIFEST.json is parsed before its hash is checked only to give better messages (sizes);
    # nothing from it is trusted until the hash row below passes.
    try:
        manifest = sums.parse_manifest((bundle / layout.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        manifest = None

    on_disk = set(sums.list_files(bundle))
    expected = set(listed) | {layout.SUMS}
    for rel in sorted(expected - on_disk):
        checks.append(Check(rel, "present", False, "missing"))
    for rel in sorted(on_disk - expected):
        checks.append(Check(rel, "expected", False, "unexpected file (not in SHA256SUMS): remove it"))
    links = sorted(r for r in on_disk & set(listed) if (bundle / r).is_symlink())
    for rel in links:
        checks.append(Check(rel, "regular file", False, "is a symlink (refused)"))
    if not (expected - on_disk) and not (on_disk - expected):
        checks.append(Check("*", "file set", True, f"{len(on_disk)} files, none missing or unexpected"))

    present = sorted((set(listed) & on_disk) - set(links))
    total = sum((bundle / r).stat().st_size for r in present)
    progress = Progress("checksums", enabled=show_progress)
    progress.start(total)
    results = hash_parallel([HashJob(r, bundle / r, (bundle / r).stat().st_size) for r in present], jobs, progress)
    progress.finish()
    good: set[str] = set()
    for rel in present:
        res = results[rel]
        if res.error:
            checks.append(Check(rel, "sha256", False, f"cannot read: {res.error}"))
        elif res.sha256 != listed[rel]:
            rec = manifest.files.get(rel) if manifest else None
            if rec is not None and res.size < rec.size:
                detail = f"truncated: {res.size} bytes, {rec.size} expected"
            elif rec is not None and res.size != rec.size:
                detail = f"size {res.size} bytes, {rec.size} expected"
            else:
                detail = "sha256 mismatch (content changed)"
            checks.append(Check(rel, "sha256", False, detail))
        else:
            good.add(rel)
    if good:
        checks.append(Check("*", "sha256", True, f"{len(good)} files, {human_bytes(total)} match SHA256SUMS"))

    if layout.MANIFEST not in good:
        if layout.MANIFEST in on_disk and layout.MANIFEST in listed:
            pass  # already reported as a hash failure
        elif layout.MANIFEST not in listed:
            checks.append(Check(layout.MANIFEST, "listed", False, "not in SHA256SUMS"))
        return done()
    if manifest is None:
        checks.append(Check(layout.MANIFEST, "parse", False, "not a v4flash bundle manifest"))
        return done()

    cross = sorted(
        r for r in set(listed) | set(manifest.files)
        if r != layout.MANIFEST and (r not in manifest.files or listed.get(r) != manifest.files[r].sha256)
    )
    for rel in cross:
        checks.append(Check(rel, "MANIFEST.json vs SHA256SUMS", False, "the two lists disagree about this file"))
    if not cross:
        checks.append(Check(layout.MANIFEST, "agrees with SHA256SUMS", True))

    lock = _check_lock(bundle, manifest, good, checks)
    if manifest.image:
        _check_image(bundle, manifest, good, checks, show_progress)
    if manifest.wheelhouse and lock is not None:
        from v4flash_pd.bundle.wheelhouse import check_wheels

        wheels = {r.split("/", 1)[1]: listed[r] for r in listed if r.startswith(layout.WHEELHOUSE + "/")}
        problems = check_wheels(lock, wheels)
        for p in problems:
            checks.append(Check(f"{layout.WHEELHOUSE}/{p.split(':', 1)[0]}", "wheel vs stack.lock", False, p.split(": ", 1)[-1]))
        if not problems:
            checks.append(Check(layout.WHEELHOUSE, "hashes in stack.lock", True, f"{len(wheels)} files"))
    _check_model(bundle, manifest, good, checks, model, full, show_progress)
    return done()


def _check_lock(bundle: Path, manifest: sums.BundleManifest, good: set[str], checks: list[Check]) -> StackLock | None:
    if layout.LOCK not in good:
        return None
    actual = hashlib.sha256((bundle / layout.LOCK).read_bytes()).hexdigest()
    if actual != manifest.lock_sha256:
        checks.append(Check(layout.LOCK, "sha256 vs MANIFEST.json", False, f"{actual[:12]} != {manifest.lock_sha256[:12]}"))
        return None
    try:
        lock = load_lock(bundle / layout.LOCK)
    except UserError as exc:
        checks.append(Check(layout.LOCK, "parse", False, exc.message))
        return None
    checks.append(Check(layout.LOCK, "sha256 vs MANIFEST.json", True, f"{len(lock.packages)} packages"))
    if layout.SBOM in good:
        problems = sbom.check_sbom((bundle / layout.SBOM).read_text(encoding="utf-8"), lock)
        for p in problems:
            checks.append(Check(layout.SBOM, "describes stack.lock", False, p))
        if not problems:
            checks.append(Check(layout.SBOM, "describes stack.lock", True, f"{len(lock.packages)} components"))
    return lock


def _check_image(bundle: Path, manifest: sums.BundleManifest, good: set[str], checks: list[Check], show: bool) -> None:
    from v4flash_pd.bundle.image import read_archive

    img = manifest.image or {}
    rel = str(img.get("path") or layout.IMAGE_ARCHIVE)
    if rel not in good:
        return  # already failed (missing / checksum); reading it would only repeat that
    progress = Progress("read image archive", enabled=show)
    progress.start((bundle / rel).stat().st_size)
    try:
        info = read_archive(bundle / rel, progress)
    except ValueError as exc:
        checks.append(Check(rel, "zstd frame + image tar", False, str(exc)))
        return
    finally:
        progress.finish()
    bad = []
    if info.tar_sha256 != img.get("tar_sha256") or info.tar_size != img.get("tar_size"):
        bad.append("the decompressed tar differs from the one recorded at create")
    if info.config_id != img.get("id"):
        bad.append(f"archive holds image {info.config_id[:19]}, MANIFEST.json records {str(img.get('id'))[:19]}")
    for b in bad:
        checks.append(Check(rel, "image tar + ID", False, b))
    if not bad:
        tags = ", ".join(img.get("repo_tags") or []) or "untagged"
        checks.append(Check(rel, "zstd frame, tar sha256, image ID", True, f"{info.config_id[:19]} ({tags})"))


def _check_model(
    bundle: Path, manifest: sums.BundleManifest, good: set[str], checks: list[Check],
    model: Path | None, full: bool, show: bool,
) -> None:
    from v4flash_pd.bundle.preflight import check_against

    if model is None:
        if manifest.model:
            checks.append(Check(layout.MODEL_MANIFEST, "model dir", True, "not checked (pass --model PATH)"))
        return
    if not manifest.model:
        checks.append(Check(str(model), "model manifest", False, "this bundle was created without --model"))
        return
    if layout.MODEL_MANIFEST not in good:
        return
    if not Path(model).is_dir():
        checks.append(Check(str(model), "model dir", False, "does not exist or is not a directory"))
        return
    try:
        mm = modelmanifest.load_manifest(bundle / layout.MODEL_MANIFEST)
    except UserError as exc:
        checks.append(Check(layout.MODEL_MANIFEST, "parse", False, exc.message))
        return
    progress = Progress("hash model", enabled=show) if full else None
    problems = check_against(mm, Path(model), full=full, progress=progress)
    mode = "sha256" if full else "sizes"
    for p in problems:
        name, _, detail = p.partition(": ")
        checks.append(Check(f"{model}/{name}", f"model ({mode})", False, detail))
    if not problems:
        checks.append(Check(str(model), f"model ({mode})", True, f"{len(mm.files)} files, {human_bytes(mm.total_bytes)}"))
