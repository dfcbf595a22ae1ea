"""Names of everything inside a bundle directory, in one place so create/verify/load agree."""

from __future__ import annotations

from pathlib import Path

FORMAT = "v4flash-bundle/1"
MANIFEST = "MANIFEST.json"
SUMS = "SHA256SUMS"
# Detached OpenSSH signature over SHA256SUMS (`bundle create --sign`); ssh-keygen's own default name.
SIGNATURE = "SHA256SUMS.sig"
LOCK = "stack.lock"
SBOM = "sbom.cdx.json"
IMAGE_ARCHIVE = "image/image.tar.zst"
MODEL_MANIFEST = "model/manifest.json"
WHEELHOUSE = "wheelhouse"
# Resume state of an interrupted create; lives only in the partial dir, never in a finished bundle.
STATE_DIR = ".state"


def partial_dir(out: Path) -> Path:
    """The hidden work dir next to DIR: a fixed name, so a rerun finds (and resumes) it."""
    return out.parent / f".{out.name}.partial"
