"""`bundle load`: verify everything first, then load the image and prove the engine got that image.

Nothing touches the engine unless the whole verification passed (with --trust, the signature
over SHA256SUMS included). After loading, the ID the engine
reports for each recorded tag (or for the recorded ID when untagged) must be the recorded ID:
that catches an archive swapped between verify and load, and an engine that rewrote the image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from v4flash_pd.bundle import contain, modelmanifest
from v4flash_pd.bundle.image import connect, image_id_of, load_archive
from v4flash_pd.bundle.progress import Progress
from v4flash_pd.bundle.signing import TrustedKeys
from v4flash_pd.bundle.verify import VerifyReport, raise_if_failed, render_table, verify_bundle
from v4flash_pd.errors import RuntimeFailure, UserError


@dataclass(frozen=True)
class LoadResult:
    image_id: str
    repo_tags: tuple[str, ...]
    report: VerifyReport
    model_manifest_copy: Path | None = None


def load_bundle(
    bundle: Path,
    engine: str | None = None,
    model: Path | None = None,
    full: bool = False,
    jobs: int | None = None,
    show_progress: bool = True,
    log: Callable[[str], None] = print,
    trust: TrustedKeys | None = None,
) -> LoadResult:
    report = verify_bundle(bundle, model=model, full=full, jobs=jobs, show_progress=show_progress, trust=trust)
    log(render_table(report))
    raise_if_failed(report, loading=True)
    assert report.manifest is not None
    img = report.manifest.image
    if not img:
        raise UserError(
            f"bundle {bundle} has no image (it was created with --no-image)",
            "use `bundle verify` for image-less bundles, or create one with --image REF",
        )
    try:
        # Verified already; proven again right before the engine reads it (no link swapped in since).
        archive = contain.inside(Path(bundle), report.manifest.image_path)
    except ValueError as exc:
        raise RuntimeFailure(f"bundle {bundle}: the image archive path {exc}",
                             "run `bundle verify` again; nothing was loaded into the engine") from exc
    client = connect(engine)
    log(f"loading {archive} into the engine")
    progress = Progress("load image", enabled=show_progress)
    progress.start(archive.stat().st_size)
    for line in load_archive(client, archive, progress):
        log(f"  engine: {line}")
    progress.finish()
    want = str(img["id"])
    tags = tuple(img.get("repo_tags") or ())
    for ref in tags or (want,):
        got = image_id_of(client, ref)
        if got != want:
            raise RuntimeFailure(
                f"after loading {archive}, the engine reports {ref} as {got or 'absent'}, but the bundle "
                f"records {want}",
                "the archive changed after verification or the engine rewrote the image: run "
                "`bundle verify` again and check the engine's storage; do not use this image",
            )
    log(f"loaded image {want} ({', '.join(tags) or 'untagged'}); ID matches the bundle")
    copy = None
    if model is not None:
        copy = Path(model) / modelmanifest.IN_DIR_NAME
        try:
            text = contain.inside(Path(bundle), report.manifest.model_path).read_text(encoding="utf-8")
            modelmanifest.write_atomic(copy, text)
            log(f"model manifest installed at {copy} (for `up`'s preflight)")
        except (OSError, ValueError) as exc:
            log(f"note: could not write {copy} ({getattr(exc, 'strerror', None) or exc}); set V4FLASH_MODEL_MANIFEST="
                f"{Path(bundle) / report.manifest.model_path} for `up`'s preflight")
            copy = None
    return LoadResult(want, tags, report, copy)
