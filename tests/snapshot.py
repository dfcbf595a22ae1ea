"""Golden-file comparison shared by the snapshot tests (plan --json, render slurm|k8s).

An intended change is regenerated with V4FLASH_UPDATE_SNAPSHOTS=1 and reviewed as a git diff; any
other difference fails with the unified diff, so a changed argv or manifest is never a surprise.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest


def check_snapshot(got: str, path: Path, what: str = "") -> None:
    if os.environ.get("V4FLASH_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    assert path.exists(), f"no snapshot {path.name}: run with V4FLASH_UPDATE_SNAPSHOTS=1 and commit it"
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(path), what or "now"))
        pytest.fail(f"{path.name} changed:\n{diff[:6000]}")
