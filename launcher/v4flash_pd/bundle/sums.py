"""SHA256SUMS and MANIFEST.json: the two files that say what a bundle contains.

SHA256SUMS uses coreutils' format (`<hex>  <path>`), so the far side can check a bundle with plain
`sha256sum -c SHA256SUMS` even before v4flash-pd is installed. It covers every file but itself,
MANIFEST.json included; MANIFEST.json repeats each file's size and sha256, so a damaged SHA256SUMS
line is caught by the cross-check rather than trusted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from v4flash_pd.bundle import layout

_LINE = re.compile(r"^(?P<hex>[0-9a-f]{64}) [ *](?P<path>.+)$")


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


def format_sums(digests: dict[str, str]) -> str:
    return "".join(f"{digests[p]}  {p}\n" for p in sorted(digests))


def parse_sums(text: str) -> dict[str, str]:
    """Pure; ValueError names the first bad line (a flipped byte usually lands here or in a hash)."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"line {lineno} is not `<sha256>  <path>`: {line[:100]!r}")
        path = m.group("path")
        if path.startswith("/") or ".." in path.split("/") or path == layout.SUMS:
            raise ValueError(f"line {lineno} names a path outside the bundle: {path!r}")
        if path in out:
            raise ValueError(f"line {lineno} lists {path} twice")
        out[path] = m.group("hex")
    return out


@dataclass(frozen=True)
class BundleManifest:
    """MANIFEST.json; `files` covers everything except MANIFEST.json and SHA256SUMS."""

    created: str
    tool_version: str
    lock_sha256: str
    files: dict[str, FileEntry]
    image: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    wheelhouse: dict[str, Any] | None = None
    sbom: dict[str, Any] = field(default_factory=dict)
    fmt: str = layout.FORMAT

    def to_json(self) -> str:
        doc = {
            "format": self.fmt,
            "created": self.created,
            "tool": {"name": "v4flash-pd", "version": self.tool_version},
            "lock": {"path": layout.LOCK, "sha256": self.lock_sha256},
            "sbom": self.sbom,
            "image": self.image,
            "model": self.model,
            "wheelhouse": self.wheelhouse,
            "files": {p: {"size": e.size, "sha256": e.sha256} for p, e in sorted(self.files.items())},
        }
        return json.dumps(doc, indent=1) + "\n"


def parse_manifest(text: str) -> BundleManifest:
    """Pure; ValueError says what is malformed."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("format") != layout.FORMAT:
        raise ValueError(f"format is {doc.get('format')!r}, expected {layout.FORMAT!r}")
    try:
        files = {
            str(p): FileEntry(int(e["size"]), str(e["sha256"])) for p, e in dict(doc["files"]).items()
        }
        return BundleManifest(
            created=str(doc["created"]),
            tool_version=str(doc["tool"]["version"]),
            lock_sha256=str(doc["lock"]["sha256"]),
            files=files,
            image=doc.get("image"),
            model=doc.get("model"),
            wheelhouse=doc.get("wheelhouse"),
            sbom=dict(doc.get("sbom") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"missing or malformed field ({exc})") from exc


def list_files(root: Path) -> list[str]:
    """Every file under `root` as a relative POSIX path (symlinks count as files: refused later)."""
    out = []
    for path in root.rglob("*"):
        if path.is_file() or path.is_symlink():
            out.append(path.relative_to(root).as_posix())
    return sorted(out)
