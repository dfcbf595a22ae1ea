"""`bundle verify`: prove a copied bundle is exactly what `create` wrote, offline.

Order matters for the messages: first what is on disk (symlinks and special files are refused
before anything is opened), then SHA256SUMS and, with --trust, its signature (an untrusted bundle
is not worth hashing), then the file set (missing / unexpected files), then every checksum (in
parallel), then the cross-checks that need intact files (MANIFEST.json vs SHA256SUMS, every path
MANIFEST.json declares listed in SHA256SUMS, lock hash, SBOM vs lock, image archive read end to
end, wheelhouse vs lock), then the model dir against the bundled model manifest. Every failing
row names the file it is about.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from v4flash_pd.bundle import contain, layout, modelmanifest, sbom, signing, sums
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


_SIGNATURE_HINT = (
    "have the bundle signed by its creator (`bundle create --sign KEY`), or copy it and its SHA256SUMS.sig "
    "again from them, and check that --trust names the public half of that KEY (KEY.pub); do not use a "
    "bundle whose signature does not verify"
)


def raise_if_failed(report: VerifyReport, loading: bool = False) -> None:
    if report.ok:
        return
    named = "; ".join(f"{c.subject}: {c.detail or c.what}" for c in report.failures[:12])
    more = f" (and {len(report.failures) - 12} more)" if len(report.failures) > 12 else ""
    if any(c.what.startswith("signature") for c in report.failures):
        hint = _SIGNATURE_HINT
    else:
        hint = ("copy the named files again from the connected side (compare with `sha256sum -c SHA256SUMS` "
                "there), remove anything that is not part of the bundle, or recreate the bundle with "
                "`v4flash-pd bundle create`")
    raise RuntimeFailure(
        f"bundle {report.bundle} failed verification: {named}{more}",
        hint + ("; nothing was loaded into the engine" if loading else ""),
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


def _check_signature(
    root: Path, tree: contain.Tree, sums_bytes: bytes, trust: signing.TrustedKeys, checks: list[Check]
) -> bool:
    """True when SHA256SUMS.sig is a good signature over exactly the SHA256SUMS bytes parsed."""
    sig = layout.SIGNATURE
    if sig not in tree.files:
        if tree.kind_of(sig) is None:  # a link or FIFO in its place is already a failed row
            checks.append(Check(sig, "signature", False,
                                "missing: the bundle is not signed, and --trust requires a signature"))
        return False
    try:
        data = contain.read_regular(root / sig)
    except (OSError, ValueError) as exc:
        checks.append(Check(sig, "signature", False, f"cannot read: {getattr(exc, 'strerror', None) or exc}"))
        return False
    try:
        line = signing.verify(sums_bytes, data, trust)
    except signing.SignatureInvalid as exc:
        checks.append(Check(sig, "signature over SHA256SUMS", False, str(exc)))
        return False
    checks.append(Check(sig, "signature over SHA256SUMS", True, line))
    return True


def verify_bundle(
    bundle: Path,
    model: Path | None = None,
    full: bool = False,
    jobs: int | None = None,
    show_progress: bool = True,
    log: Callable[[str], None] = lambda _m: None,
    trust: signing.TrustedKeys | None = None,
) -> VerifyReport:
    """Every check in docs/bundle.md's order; with `trust`, an unsigned or badly signed bundle fails.

    Each step appends its rows to `checks` and the first whose failure makes the rest meaningless
    ends the walk: the file tree, SHA256SUMS, the signature, the file set, the hashes, MANIFEST.json,
    then what it declares (lock, image, wheelhouse, model).
    """
    bundle = Path(bundle)
    _check_dir(bundle)
    root = bundle.resolve()
    checks: list[Check] = []
    manifest: sums.BundleManifest | None = None

    def done() -> VerifyReport:
        return VerifyReport(bundle, tuple(checks), manifest)

    # Nothing is opened before the walk has said what it is: a FIFO named SHA256SUMS would block.
    tree = contain.walk(root)
    refused = {rel for rel, _kind in tree.refused}
    for rel, kind in tree.refused:
        checks.append(Check(rel, "regular file", False, f"is {kind} (refused: a bundle holds only regular files)"))
    read = _read_sums(root, tree.files, refused, checks)
    if read is None:
        return done()
    sums_bytes, listed = read

    if trust is not None:
        if not _check_signature(root, tree, sums_bytes, trust, checks):
            return done()  # nothing else in an untrusted bundle is worth hashing
    elif layout.SIGNATURE in tree.files:
        checks.append(Check(layout.SIGNATURE, "signature", True, "present, not checked (pass --trust PUBKEY)"))

    manifest, manifest_error = _read_manifest(root, tree.files)
    present = _check_file_set(root, set(tree.files), listed, refused, checks)
    good = _check_hashes(root, present, listed, manifest, jobs, show_progress, checks)

    if layout.MANIFEST not in good:
        if layout.MANIFEST not in listed:
            checks.append(Check(layout.MANIFEST, "listed", False, "not in SHA256SUMS"))
        return done()  # otherwise already reported (missing, refused or a hash failure)
    if manifest is None:
        checks.append(Check(layout.MANIFEST, "parse", False, manifest_error))
        return done()
    _check_manifest_agrees(manifest, listed, checks)

    lock = _check_lock(root, manifest, good, checks)
    if manifest.image:
        _check_image(root, manifest, good, checks, show_progress)
    if manifest.wheelhouse and lock is not None:
        _check_wheelhouse(manifest, listed, lock, checks)
    _check_model(root, manifest, good, checks, model, full, show_progress)
    return done()


def _read_sums(root: Path, files: Collection[str], refused: set[str],
               checks: list[Check]) -> tuple[bytes, dict[str, str]] | None:
    """SHA256SUMS's bytes and rows, or None (and the row saying why) when it is missing or damaged."""
    if layout.SUMS not in files:
        if layout.SUMS not in refused:
            checks.append(Check(layout.SUMS, "present", False, "missing (not a complete bundle)"))
        return None
    try:
        sums_bytes = contain.read_regular(root / layout.SUMS)
        listed = sums.parse_sums(sums_bytes.decode("utf-8"))
    except OSError as exc:
        checks.append(Check(layout.SUMS, "parse", False, f"cannot read: {exc.strerror}"))
        return None
    except (ValueError, UnicodeDecodeError) as exc:
        checks.append(Check(layout.SUMS, "parse", False, f"damaged: {exc}"))
        return None
    checks.append(Check(layout.SUMS, "parse", True, f"{len(listed)} entries"))
    return sums_bytes, listed


def _read_manifest(root: Path, files: Collection[str]) -> tuple[sums.BundleManifest | None, str]:
    """MANIFEST.json parsed before its hash is checked, only to give better messages (sizes); nothing
    from it is trusted until its hash row passes. (manifest or None, why it did not parse)."""
    if layout.MANIFEST not in files:
        return None, "not a v4flash bundle manifest"
    try:
        return sums.parse_manifest(contain.read_regular(root / layout.MANIFEST).decode("utf-8")), ""
    except (OSError, UnicodeDecodeError):
        return None, "not a v4flash bundle manifest"
    except ValueError as exc:
        return None, str(exc)


def _check_file_set(root: Path, on_disk: set[str], listed: dict[str, str], refused: set[str],
                    checks: list[Check]) -> list[str]:
    """Rows for missing and unexpected files; the listed files present inside the bundle, to hash."""
    expected = set(listed) | {layout.SUMS} | ({layout.SIGNATURE} & on_disk)
    missing = sorted(expected - on_disk - refused)
    extra = sorted(on_disk - expected)
    for rel in missing:
        checks.append(Check(rel, "present", False, "missing"))
    for rel in extra:
        checks.append(Check(rel, "expected", False, "unexpected file (not in SHA256SUMS): remove it"))
    if not missing and not extra and not refused:
        checks.append(Check("*", "file set", True, f"{len(on_disk)} files, none missing or unexpected"))
    present = []
    for rel in sorted(set(listed) & on_disk):
        try:
            contain.inside(root, rel)
        except ValueError as exc:
            checks.append(Check(rel, "inside the bundle", False, str(exc)))
            continue
        present.append(rel)
    return present


def _check_hashes(root: Path, present: list[str], listed: dict[str, str], manifest: sums.BundleManifest | None,
                  jobs: int | None, show_progress: bool, checks: list[Check]) -> set[str]:
    """Hash every present file against SHA256SUMS (in parallel); the files that match."""
    sizes = {r: (root / r).stat().st_size for r in present}
    total = sum(sizes.values())
    progress = Progress("checksums", enabled=show_progress)
    progress.start(total)
    results = hash_parallel([HashJob(r, root / r, sizes[r], regular_only=True) for r in present], jobs, progress)
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
    return good


def _check_manifest_agrees(manifest: sums.BundleManifest, listed: dict[str, str], checks: list[Check]) -> None:
    """MANIFEST.json and SHA256SUMS list the same files and hashes, and every path it declares is listed."""
    cross = sorted(
        r for r in set(listed) | set(manifest.files)
        if r != layout.MANIFEST and (r not in manifest.files or listed.get(r) != manifest.files[r].sha256)
    )
    for rel in cross:
        checks.append(Check(rel, "MANIFEST.json vs SHA256SUMS", False, "the two lists disagree about this file"))
    if not cross:
        checks.append(Check(layout.MANIFEST, "agrees with SHA256SUMS", True))
    uncovered = {key: rel for key, rel in manifest.declared().items() if rel not in listed}
    for key, rel in sorted(uncovered.items()):
        checks.append(Check(rel, f"{key}.path in SHA256SUMS", False,
                            f"MANIFEST.json declares the {key} here, but SHA256SUMS does not list it"))
    if not uncovered:
        declared = ", ".join(sorted(manifest.declared()))
        checks.append(Check(layout.MANIFEST, "declared paths in SHA256SUMS", True, declared))


def _check_wheelhouse(manifest: sums.BundleManifest, listed: dict[str, str], lock: StackLock, checks: list[Check]) -> None:
    from v4flash_pd.bundle.wheelhouse import check_wheels

    prefix = manifest.wheelhouse_path + "/"
    wheels = {r[len(prefix):]: listed[r] for r in listed if r.startswith(prefix)}
    problems = check_wheels(lock, wheels)
    for p in problems:
        checks.append(Check(f"{prefix}{p.split(':', 1)[0]}", "wheel vs stack.lock", False, p.split(": ", 1)[-1]))
    declared = (manifest.wheelhouse or {}).get("files")
    if isinstance(declared, int) and declared != len(wheels):
        checks.append(Check(manifest.wheelhouse_path, "wheel count", False,
                            f"MANIFEST.json says {declared} files, SHA256SUMS lists {len(wheels)}"))
    elif not problems:
        checks.append(Check(manifest.wheelhouse_path, "hashes in stack.lock", True, f"{len(wheels)} files"))


def _check_lock(bundle: Path, manifest: sums.BundleManifest, good: set[str], checks: list[Check]) -> StackLock | None:
    rel = manifest.lock_path
    if rel not in good:
        return None
    actual = hashlib.sha256((bundle / rel).read_bytes()).hexdigest()
    if actual != manifest.lock_sha256:
        checks.append(Check(rel, "sha256 vs MANIFEST.json", False, f"{actual[:12]} != {manifest.lock_sha256[:12]}"))
        return None
    try:
        lock = load_lock(bundle / rel)
    except UserError as exc:
        checks.append(Check(rel, "parse", False, exc.message))
        return None
    checks.append(Check(rel, "sha256 vs MANIFEST.json", True, f"{len(lock.packages)} packages"))
    sbom_rel = manifest.sbom_path
    if sbom_rel in good:
        problems = sbom.check_sbom((bundle / sbom_rel).read_text(encoding="utf-8"), lock)
        for p in problems:
            checks.append(Check(sbom_rel, "describes stack.lock", False, p))
        if not problems:
            checks.append(Check(sbom_rel, "describes stack.lock", True, f"{len(lock.packages)} components"))
    return lock


def _check_image(bundle: Path, manifest: sums.BundleManifest, good: set[str], checks: list[Check], show: bool) -> None:
    from v4flash_pd.bundle.image import read_archive

    img = manifest.image or {}
    rel = manifest.image_path
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
            checks.append(Check(manifest.model_path, "model dir", True, "not checked (pass --model PATH)"))
        return
    if not manifest.model:
        checks.append(Check(str(model), "model manifest", False, "this bundle was created without --model"))
        return
    if manifest.model_path not in good:
        return
    if not Path(model).is_dir():
        checks.append(Check(str(model), "model dir", False, "does not exist or is not a directory"))
        return
    try:
        mm = modelmanifest.load_manifest(bundle / manifest.model_path)
    except UserError as exc:
        checks.append(Check(manifest.model_path, "parse", False, exc.message))
        return
    progress = Progress("hash model", enabled=show) if full else None
    problems = check_against(mm, Path(model), full=full, progress=progress)
    mode = "sha256" if full else "sizes"
    for p in problems:
        name, _, detail = p.partition(": ")
        checks.append(Check(f"{model}/{name}", f"model ({mode})", False, detail))
    if not problems:
        checks.append(Check(str(model), f"model ({mode})", True, f"{len(mm.files)} files, {human_bytes(mm.total_bytes)}"))
