"""Is the run dir's filesystem full? A full disk does not stop serving, but from then on every role
log line, state write and event is lost, so "ready" alone would be a lie.

The launcher looks every few seconds after READY and says so once when space runs out (and once
when it comes back); `status` looks for itself, because state.json cannot record it on a full disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Below this many free bytes a run dir counts as full: a SGLang worker logs far more than that per minute.
LOW_SPACE = 1 << 20


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on `path`'s filesystem; None when it cannot be asked."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def full_note(path: Path, low: int = LOW_SPACE) -> str:
    """'' while there is room, else the words `status` and the launcher use."""
    free = free_bytes(path)
    if free is None or free >= low:
        return ""
    return f"run dir is full ({free // 1024} KiB free on its filesystem): role logs and state are being lost"


@dataclass
class DiskWatch:
    """Edge-triggered: `check` returns a message only when the state changes (full <-> room again)."""

    path: Path
    every: float = 2.0
    low: int = LOW_SPACE
    _next: float = 0.0
    full: bool = False

    def check(self, now: float) -> str:
        if now < self._next:
            return ""
        self._next = now + self.every
        note = full_note(self.path, self.low)
        if note and not self.full:
            self.full = True
            return (f"WARNING {note}; the run keeps serving. Free space there (df -h {self.path}), "
                    "or stop it and pass --run-dir on another filesystem")
        if not note and self.full:
            self.full = False
            return f"run dir has space again ({self.path}); logging resumes"
        return ""
