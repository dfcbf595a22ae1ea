"""Port checks: every port a plan uses must be free before anything starts.

SGLang picks some ports by bind-then-close (a TOCTOU race between two servers on one box), so
the plan names every port and we refuse to start if one is taken.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Literal

WILDCARD_HOSTS = ("0.0.0.0", "::")
PortKind = Literal["http", "bootstrap", "nccl", "metrics"]


@dataclass(frozen=True)
class PortUse:
    """One listening port of a planned process."""

    process: str  # the process that listens, e.g. "decode-0", "router"
    kind: PortKind
    host: str
    port: int

    @property
    def owner(self) -> str:
        """For people: "decode-0 http"."""
        return f"{self.process} {self.kind}"


def is_ip(host: str) -> bool:
    """An IP literal (no resolver involved). Host names cannot contain ':', so any ':' is IPv6."""
    if ":" in host:
        return True
    parts = host.split(".")
    return len(parts) == 4 and all(p.isdigit() and int(p) <= 255 for p in parts)


def url_host(host: str) -> str:
    """A host as it goes into a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def port_problem(host: str, port: int) -> str:
    """'' when a listener could bind host:port now, else why not, in words an operator acts on.

    SO_REUSEADDR like uvicorn/SGLang, so a TIME_WAIT left by the previous run is not mistaken for a
    busy port. An address that is not on this host cannot be busy here ('').
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        return f"host {host!r} does not resolve ({exc})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "already in use"
            if exc.errno == errno.EACCES:
                return ("permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)" if port < 1024
                        else "permission denied")
            if exc.errno == errno.EADDRNOTAVAIL:
                return ""
            return f"cannot bind: {exc.strerror or exc}"
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that is free right now (tests and rehearsal helpers)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
