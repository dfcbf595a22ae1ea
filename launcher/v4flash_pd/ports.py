"""Port checks: every port a plan uses must be free before anything starts.

SGLang picks some ports by bind-then-close (a TOCTOU race between two servers on one box,
dynamo#15099), so the plan names every port and we refuse to start if one is taken.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class PortUse:
    owner: str  # e.g. "decode-0 http"
    host: str
    port: int


def is_free(host: str, port: int) -> bool:
    """True when a listener could bind host:port now (SO_REUSEADDR, like uvicorn/SGLang do, so a
    TIME_WAIT left by the previous run is not mistaken for a busy port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            if exc.errno == errno.EADDRNOTAVAIL:  # an address not on this host: cannot be busy here
                return True
            raise
    return True


def busy_ports(uses: tuple[PortUse, ...] | list[PortUse]) -> list[PortUse]:
    return [u for u in uses if not is_free(u.host if u.host else "0.0.0.0", u.port)]


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that is free right now (tests and rehearsal helpers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
