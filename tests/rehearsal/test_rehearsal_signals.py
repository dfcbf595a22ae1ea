"""The stand-in's stop signal handler must not take a lock the interrupted main thread may hold.

A Python signal handler runs in the main thread between two bytecodes, possibly while that thread is
inside `Event.wait()`'s bookkeeping and holds the Event's (non-reentrant) condition lock; a handler
that calls `Event.set()` then waits for that lock forever, and the stand-in needed SIGKILL after
SIGTERM (seen once in a run). The test delivers the handler exactly in that state, in a subprocess
with a deadline, and then checks the stand-in still stops on a real SIGTERM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rehearsal_procs import Proc, wait_status

SCRIPT = r"""
import os, signal, threading
from v4flash_pd.rehearsal import engine

made = []

class RecordedEvent(threading.Event):
    def __init__(self):
        super().__init__()
        made.append(self)

threading.Event = RecordedEvent
real_signal = signal.signal

def spy(sig, handler):
    if sig == signal.SIGTERM and callable(handler):
        # the main thread holds every Event's condition lock, as inside Event.wait(), when the signal lands
        held = [e._cond for e in made]
        for c in held:
            c.acquire()
        try:
            handler(sig, None)
        finally:
            for c in held:
                c.release()
        print("handler returned", flush=True)
        os._exit(0)
    return real_signal(sig, handler)

signal.signal = spy
engine.run(["--model-path", "m", "--host", "127.0.0.1", "--port", "1"])
"""


def test_stop_handler_takes_no_lock_the_main_thread_may_hold() -> None:
    try:
        res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError("the SIGTERM handler deadlocked on a lock the main thread held") from None
    assert res.returncode == 0 and "handler returned" in res.stdout, res.stdout + res.stderr


def test_a_loaded_stand_in_stops_on_sigterm_within_a_second(procs: list[Proc], start_engine, tmp_path: Path) -> None:
    import signal
    import time

    p = start_engine("engine")
    wait_status(p.port, "/health", 200, timeout=20)  # type: ignore[attr-defined]
    t0 = time.monotonic()
    p.popen.send_signal(signal.SIGTERM)
    assert p.popen.wait(10) == 0, p.text()
    assert time.monotonic() - t0 < 1.0, f"took {time.monotonic() - t0:.2f}s"
    assert "received a stop signal" in p.text()
