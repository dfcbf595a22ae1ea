"""Hang detection: a process that stops answering its health probe for `window` seconds is hung.

A crashed process is noticed by its exit; a hung one (deadlock, SIGSTOP, a GPU stuck in a kernel)
keeps its pid and its port and only stops answering. The watchdog is a pure state machine over
probe results and a clock: the supervisor feeds it, tests drive it with a fake clock. Probes run
every window/3 (or `every`) with a timeout of at most window/3, cut to the window's end, so a hang
is declared at most `window` seconds after the last good answer (plus one supervisor tick), and only after at least
`min_misses` probes failed: one slow answer is not a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Watch:
    url: str
    last_ok: float
    next_due: float
    misses: int = 0
    in_flight: bool = False
    last_problem: str = ""


@dataclass(frozen=True)
class Hang:
    name: str
    silent_for: float
    misses: int
    problem: str


@dataclass
class Watchdog:
    window: float
    min_misses: int = 2
    every: float | None = None  # probe cadence; default window/3 (a loading worker is polled faster)
    watches: dict[str, _Watch] = field(default_factory=dict)

    @property
    def interval(self) -> float:
        return max(0.05, self.every if self.every is not None else self.window / 3)

    @property
    def probe_timeout(self) -> float:
        return max(0.05, self.window / 3)

    def add(self, name: str, url: str, now: float) -> None:
        self.watches[name] = _Watch(url, last_ok=now, next_due=now)

    def remove(self, name: str) -> None:
        """Stop watching `name` (a worker the health gate has seen healthy)."""
        self.watches.pop(name, None)

    def due(self, now: float) -> list[tuple[str, str, float]]:
        """(name, url, timeout) of each probe to start now; each is then in flight until `observe`."""
        out = []
        for name, w in self.watches.items():
            if not w.in_flight and now >= w.next_due:
                w.in_flight = True
                left = w.last_ok + self.window - now
                out.append((name, w.url, max(0.05, min(self.probe_timeout, left))))
        return out

    def observe(self, name: str, ok: bool, started: float, now: float, problem: str = "") -> None:
        w = self.watches[name]
        w.in_flight = False
        if ok:
            w.last_ok = max(w.last_ok, started)
            w.misses = 0
            w.last_problem = ""
        else:
            w.misses += 1
            w.last_problem = problem
        w.next_due = max(now, started + self.interval) if ok else now + min(self.interval, 0.25)

    def hung(self, now: float) -> list[Hang]:
        return [Hang(n, now - w.last_ok, w.misses, w.last_problem) for n, w in self.watches.items()
                if now - w.last_ok >= self.window and w.misses >= self.min_misses]
