"""One bounded wait loop, and the clock seam every waiting part of the launcher takes.

Waits go through `poll_until` with a `Clock`, so tests of the supervisor's timing (grace periods,
hang windows, readiness deadlines) run on a fake clock in microseconds instead of real sleeps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Clock:
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


SYSTEM_CLOCK = Clock()


def poll_until(check: Callable[[], T], timeout: float, interval: float = 0.05,
               clock: Clock = SYSTEM_CLOCK) -> T | None:
    """Call `check` until it returns something truthy (returned) or `timeout` seconds pass (None).

    `check` runs at least once, even with timeout <= 0; the last sleep is cut to the deadline so a
    wait never overruns its budget by more than one `check`.
    """
    deadline = clock.now() + max(0.0, timeout)
    while True:
        got = check()
        if got:
            return got
        left = deadline - clock.now()
        if left <= 0:
            return None
        clock.sleep(min(interval, left))
