"""Tiny stdlib HTTP helpers for readiness probes (the launcher must not need aiohttp/requests)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    status: int  # 0 = no HTTP answer (refused, timeout)
    body: str
    error: str = ""

    def json(self) -> Any:
        return json.loads(self.body)


def request(url: str, payload: Any | None = None, timeout: float = 5.0) -> Reply:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, resp.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace") if exc.fp else ""
        return Reply(exc.code, body, str(exc))
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        return Reply(0, "", str(reason))
