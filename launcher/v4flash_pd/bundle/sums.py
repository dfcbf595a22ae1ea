"""SHA256SUMS and MANIFEST.json: the two files that say what a bundle contains.

SHA256SUMS uses coreutils' format (`<hex>  <path>`), so the far side can check a bundle with plain
`sha256sum -c SHA256SUMS` even before v4flash-pd is installed. It covers every file but itself,
MANIFEST.json included; MANIFEST.json repeats each file's size and sha256, so a damaged SHA256SUMS
line is caught by the cross-check rather than trusted.

Every name either file carries is untrusted (it crossed the air gap): both parsers refuse any
path that is absolute, climbs with `..`, or is not normalized (see `contain.rel_problem`), and
MANIFEST.json's declared paths (image, model manifest, lock, SBOM, wheelhouse) are collected in
one place so `verify` can require each to be covered by SHA256SUMS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from v4flash_pd.bundle import layout
from v4flash_pd.bundle.contain import rel_problem, walk

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
        problem = rel_problem(path)
        if problem is not None:
            raise ValueError(f"line {lineno} names a path outside the bundle: {path!r} {problem}")
        if path in (layout.SUMS, layout.SIGNATURE):
            raise ValueError(f"line {lineno} lists {path}, which cannot cover itself")
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
    lock_path: str = layout.LOCK

    def declared(self) -> dict[str, str]:
        """Every file MANIFEST.json points at outside `files`, by its JSON key (defaults filled in)."""
        out = {"lock": self.lock_path, "sbom": self.sbom_path}
        if self.image:
            out["image"] = self.image_path
        if self.model:
            out["model"] = self.model_path
        return out

    @property
    def image_path(self) -> str:
        return str((self.image or {}).get("path") or layout.IMAGE_ARCHIVE)

    @property
    def model_path(self) -> str:
        return str((self.model or {}).get("path") or layout.MODEL_MANIFEST)

    @property
    def sbom_path(self) -> str:
        return str(self.sbom.get("path") or layout.SBOM)

    @property
    def wheelhouse_path(self) -> str:
        return str((self.wheelhouse or {}).get("path") or layout.WHEELHOUSE)

    def to_json(self) -> str:
        doc = {
            "format": self.fmt,
            "created": self.created,
            "tool": {"name": "v4flash-pd", "version": self.tool_version},
            "lock": {"path": self.lock_path, "sha256": self.lock_sha256},
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
        sections = {}
        for key in ("image", "model", "wheelhouse", "sbom"):
            value = doc.get(key)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{key} is a {type(value).__name__}, expected an object")
            if value is not None and not isinstance(value.get("path", ""), str):
                raise ValueError(f"{key}.path is not a string: {value['path']!r}")
            sections[key] = value
        lock_path = doc["lock"].get("path", layout.LOCK)
        if not isinstance(lock_path, str):
            raise ValueError(f"lock.path is not a string: {lock_path!r}")
        manifest = BundleManifest(
            created=str(doc["created"]),
            tool_version=str(doc["tool"]["version"]),
            lock_sha256=str(doc["lock"]["sha256"]),
            files=files,
            image=sections["image"],
            model=sections["model"],
            wheelhouse=sections["wheelhouse"],
            sbom=dict(sections["sbom"] or {}),
            lock_path=lock_path,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"missing or malformed field ({exc})") from exc
    _check_paths(manifest)
    return manifest


def _check_paths(manifest: BundleManifest) -> None:
    """Every path MANIFEST.json names must be a plain relative path inside the bundle."""
    named = [(f"files[{p!r}]", p) for p in manifest.files]
    named += [(f"{key}.path", p) for key, p in manifest.declared().items()]
    if manifest.wheelhouse:
        named.append(("wheelhouse.path", manifest.wheelhouse_path))
    for where, path in named:
        problem = rel_problem(path)
        if problem is not None:
            raise ValueError(f"{where} = {path!r} {problem}; every path must stay inside the bundle")
        if path in (layout.SUMS, layout.SIGNATURE, layout.MANIFEST) and where.startswith("files"):
            raise ValueError(f"{where} lists {path}, which `files` never covers")


def list_files(root: Path) -> list[str]:
    """Every entry under `root` that is not a directory (links and special files included)."""
    tree = walk(root)
    return sorted(tree.files | {rel for rel, _kind in tree.refused})
