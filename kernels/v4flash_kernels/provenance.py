"""Which commit a benchmark measured, for the tables in kernels/BENCH.md and docs/decode-step.md.

A GPU box gets a copy of the working tree whose `.git` can be stale, so `$V4FLASH_COMMIT` (set by
whoever sends the run) wins over asking git.
"""

from __future__ import annotations

import os
import subprocess


def measured_commit() -> str:
    """`$V4FLASH_COMMIT`, else the short HEAD of the tree this file is in, else "unknown"."""
    if os.environ.get("V4FLASH_COMMIT"):
        return os.environ["V4FLASH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except Exception:
        return "unknown"
