"""The report directory as one .tar.gz next to it (what the operator sends)."""

from __future__ import annotations

import tarfile
from pathlib import Path


def target(directory: Path) -> Path:
    return directory.with_name(directory.name + ".tar.gz")


def pack(directory: Path) -> Path:
    out = target(directory)
    tmp = out.with_name("." + out.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(directory, arcname=directory.name)
    tmp.replace(out)
    return out
