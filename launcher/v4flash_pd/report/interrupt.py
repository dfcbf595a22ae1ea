"""`report` is stopped the way a person or a scheduler stops things (Ctrl-C, SIGTERM, a closed terminal)
and must stop what it started first: the signal becomes an `Interrupted` exception in the main
thread, which every variant's cleanup sees on its way out. Cleanup itself runs `shielded`: a second
signal there is noted, not raised, so stopping a trio is never cut short halfway.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from types import FrameType
from typing import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A stop signal arrived (a BaseException, like KeyboardInterrupt: no `except Exception` eats it).
    `trios`: (variant, what of its trio is still running) for each trio the report stopped on its way out."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.trios: list[tuple[str, list[str]]] = []
        super().__init__(self.name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_state: dict[str, int] = {"signum": 0, "shield": 0, "raised": 0}


def _handler(signum: int, _frame: FrameType | None) -> None:
    if not _state["signum"]:
        _state["signum"] = signum
    if _state["raised"] or _state["shield"]:
        print(f"report: {signal.Signals(signum).name} received; still stopping what it started (bounded waits)",
              file=sys.stderr, flush=True)
        return
    _state["raised"] = 1
    raise Interrupted(signum)


def interrupted(name: str) -> Interrupted:
    """The `Interrupted` for a signal another part caught first (the self-check's own handlers), by name."""
    signum = int(signal.Signals[name])
    _state.update(signum=_state["signum"] or signum, raised=1)
    return Interrupted(signum)


def install() -> Callable[[], None]:
    """Route SIGINT, SIGTERM and SIGHUP to `Interrupted`; returns the function that puts the old handlers back."""
    _state.update(signum=0, shield=0, raised=0)
    old = {s: signal.signal(s, _handler) for s in SIGNALS}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore


@contextmanager
def shielded() -> Iterator[None]:
    """Run a cleanup to its end; a signal that came meanwhile is raised after it (unless one already was)."""
    _state["shield"] += 1
    try:
        yield
    finally:
        _state["shield"] -= 1
    if not _state["shield"] and _state["signum"] and not _state["raised"]:
        _state["raised"] = 1
        raise Interrupted(_state["signum"])
