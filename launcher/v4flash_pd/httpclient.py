"""The launcher's one HTTP client (stdlib only: the launcher must not need aiohttp/requests).

A `Reply` says not only the status but how a request failed: a refused connection means nothing
listens (yet), a timeout after connecting means something listens and does not answer (hung or
stopped), and the supervisor, the watchdog and `status` report those differently.
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

OK = "ok"  # an HTTP answer (any status)
REFUSED = "refused"  # nothing listens
TIMEOUT = "timeout"  # connected (or connecting) but no answer in time
ERROR = "error"  # anything else (reset, DNS, protocol)


@dataclass(frozen=True)
class Reply:
    status: int  # 0 = no HTTP answer
    body: str
    error: str = ""
    kind: str = OK

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def answered(self) -> bool:
        return self.kind == OK


def _kind(exc: BaseException) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return TIMEOUT
    if isinstance(reason, ConnectionRefusedError):
        return REFUSED
    return ERROR


def request(url: str, payload: Any | None = None, timeout: float = 5.0,
            headers: dict[str, str] | None = None) -> Reply:
    """GET `url`, or POST `payload` as JSON; never raises for network trouble."""
    data = None if payload is None else json.dumps(payload).encode()
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET", headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=max(0.01, timeout)) as resp:
            return Reply(resp.status, resp.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read().decode("utf-8", "replace") if exc.fp else ""
        except (OSError, TimeoutError):
            body = ""
        return Reply(exc.code, body, str(exc))
    except (urllib.error.URLError, OSError, TimeoutError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        return Reply(0, "", str(reason) or type(reason).__name__, _kind(exc))


class Probes:
    """GET probes running in the background, one per name at a time, so one hung peer cannot stall
    the supervisor's loop (signals, exits and the other peers' probes are handled meanwhile)."""

    def __init__(self, fetch: Callable[[str, float], Reply] | None = None) -> None:
        self._fetch = fetch or (lambda url, timeout: request(url, timeout=timeout))
        self._done: queue.SimpleQueue[tuple[str, float, Reply]] = queue.SimpleQueue()
        self.in_flight: set[str] = set()

    def start(self, name: str, url: str, timeout: float, started: float,
              fetch: Callable[[str, float], Reply] | None = None) -> None:
        self.in_flight.add(name)
        get = fetch or self._fetch

        def run() -> None:
            self._done.put((name, started, get(url, timeout)))

        threading.Thread(target=run, name=f"probe-{name}", daemon=True).start()

    def results(self) -> list[tuple[str, float, Reply]]:
        out: list[tuple[str, float, Reply]] = []
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return out
            self.in_flight.discard(item[0])
            out.append(item)
