"""A byte-counting progress bar on stderr, safe to advance from many hashing threads.

On a terminal it redraws one line; in logs (CI, pipes) it prints a line every few seconds, so a
multi-hour hash of a 300 GB model still shows it is alive without flooding the log.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


class Progress:
    """Counts bytes; `advance` is thread-safe and cheap (drawing is rate-limited)."""

    def __init__(
        self,
        label: str,
        total: int = 0,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval: float | None = None,
    ) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._interval = interval if interval is not None else (0.2 if self._tty else 5.0)
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last_draw = self._start

    def start(self, total: int, label: str | None = None) -> None:
        with self._lock:
            self.total = total
            self.done = 0
            if label is not None:
                self.label = label
            self._start = time.monotonic()
            self._last_draw = self._start

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if self.enabled and now - self._last_draw >= self._interval:
                self._last_draw = now
                self._draw(now, final=False)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def rate(self) -> float:
        """Bytes per second since start."""
        return self.done / max(self.elapsed, 1e-9)

    def finish(self, note: str = "") -> None:
        with self._lock:
            now = time.monotonic()
            # In logs, a run too short to have drawn anything gets no bar at all (summary suffices).
            if self.enabled and (self._tty or now - self._start >= 1.0):
                self._draw(now, final=True, note=note)

    def _draw(self, now: float, final: bool, note: str = "") -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        if self.total:
            pct = min(100.0, 100.0 * self.done / self.total)
            width = 24
            fill = int(width * pct / 100)
            bar = "#" * fill + "-" * (width - fill)
            eta = (self.total - self.done) / rate if rate > 0 and not final else 0.0
            text = (
                f"{self.label} [{bar}] {pct:5.1f}% {human_bytes(self.done)}/{human_bytes(self.total)} "
                f"{rate / 1e6:.0f} MB/s" + (f" eta {eta:.0f}s" if not final else f" in {elapsed:.1f}s")
            )
        else:
            text = f"{self.label} {human_bytes(self.done)} {rate / 1e6:.0f} MB/s"
        if note:
            text += f" {note}"
        if self._tty:
            self.stream.write("\r" + text + ("\n" if final else "\x1b[K"))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
