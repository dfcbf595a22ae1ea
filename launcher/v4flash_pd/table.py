"""Tables and progress lines for every human-readable report (plan, doctor, bench, topology), so
columns line up the same way everywhere and tests parse one format."""

from __future__ import annotations

import sys
import threading
import time
from typing import Sequence, TextIO


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] | range = (),
                 indent: str = "") -> list[str]:
    """Lines of a table: columns two spaces apart, `right` = indices of right-aligned columns,
    trailing blanks stripped. Every cell is text already (callers format numbers their own way)."""
    table = [tuple(header)] + [tuple(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    out = []
    for r in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


class Progress:
    """A one-line progress bar on stderr (redrawn with \\r on a tty, one summary line otherwise)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.errors = 0
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def tick(self, ok: bool) -> None:
        with self._lock:
            self.done += 1
            self.errors += 0 if ok else 1
            if self.tty:
                self.stream.write("\r" + self._line())
                self.stream.flush()

    def _line(self) -> str:
        filled = int(self.width * self.done / max(self.total, 1))
        return (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}"
                f" err={self.errors} {time.monotonic() - self._t0:.1f}s")

    def close(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self._line() + "\n")
        self.stream.flush()
