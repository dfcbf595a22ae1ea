"""Fixtures for the rehearsal stand-in tests: engines and the real router as subprocesses."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
from rehearsal_procs import Proc, engine_argv, free_ports, spawn, wait_status

FAST_ENV = {
    "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.3",
    "V4FLASH_REHEARSAL_WAITING_TIMEOUT_S": "1.0",
    "V4FLASH_REHEARSAL_BOOTSTRAP_TIMEOUT_S": "1.0",
}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    """Every process a test starts goes here; all are stopped (group SIGTERM, then SIGKILL)."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop(grace=3.0)


@pytest.fixture
def start_engine(procs: list[Proc], tmp_path: Path) -> Callable[..., Proc]:
    """Start a stand-in on free ports; waits for /health 200 unless wait=False."""

    def start(name: str = "engine", mode: str = "null", port: int | None = None,
              boot_port: int | None = None, extra: list[str] | None = None,
              env: dict[str, str] | None = None, wait: bool = True) -> Proc:
        if port is None:
            port = free_ports(1)[0]
        p = spawn(name, engine_argv(port, mode, boot_port, extra), tmp_path,
                  {**FAST_ENV, **(env or {})})
        p.port = port  # type: ignore[attr-defined]
        p.boot_port = boot_port  # type: ignore[attr-defined]
        procs.append(p)
        if wait:
            try:
                wait_status(port, "/health", 200, timeout=20)
            except AssertionError:
                raise AssertionError(f"{name} never became healthy; log:\n{p.text()}") from None
        return p

    return start
