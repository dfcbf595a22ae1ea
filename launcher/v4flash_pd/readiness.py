"""The readiness gate: what "ready" means, as checks over probe replies (no processes, no sleeping).

READY needs every worker's /health 200, then the router reporting the expected prefill/decode
counts (a router can call itself ready before its prefill is, sglang#33740), then one real generate
through the front door; the supervisor drives these checks and decides when to give up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from v4flash_pd.httpclient import REFUSED, TIMEOUT, Reply

Fetch = Callable[[str, float], Reply]


def describe(rep: Reply, proc_state: str = "", timeout: float = 0.0) -> str:
    """How a worker that is not healthy yet looks from outside, in an operator's words."""
    if proc_state:
        return f"not answering ({proc_state})"
    if rep.kind == REFUSED:
        return "not listening yet"
    if rep.kind == TIMEOUT:
        return f"not answering (accepts connections, no reply within {timeout:g}s: hung?)"
    if not rep.answered:
        return f"no answer ({rep.error})"
    return f"loading (HTTP {rep.status})"


def is_miss_while_loading(rep: Reply, proc_state: str) -> bool:
    """While loading, refusing connections or answering 503 is normal; going silent is not."""
    return bool(proc_state) or rep.kind == TIMEOUT


def is_miss_when_ready(rep: Reply, proc_state: str) -> bool:
    """After READY anything but 200 counts (SGLang answers 503 when its scheduler stops responding)."""
    return bool(proc_state) or rep.status != 200


@dataclass
class HealthGate:
    """Workers that answered /health 200 at least once; the rest with their latest description."""

    names: tuple[str, ...]
    healthy: set[str] = field(default_factory=set)
    latest: dict[str, str] = field(default_factory=dict)

    def observe(self, name: str, rep: Reply, proc_state: str = "", timeout: float = 0.0) -> bool:
        """True when `name` just became healthy."""
        if name in self.healthy:
            return False
        if rep.status == 200 and not proc_state:
            self.healthy.add(name)
            self.latest.pop(name, None)
            return True
        self.latest[name] = describe(rep, proc_state, timeout)
        return False

    def done(self) -> bool:
        return self.healthy >= set(self.names)

    def detail(self) -> str:
        waiting = [f"{n} {self.latest.get(n, 'starting')}" for n in self.names if n not in self.healthy]
        return ", ".join(waiting) or "all healthy"


def router_check(fetch: Fetch, readiness_url: str, expected: tuple[tuple[str, int], ...],
                 timeout: float = 5.0) -> tuple[bool, str]:
    rep = fetch(readiness_url, timeout)
    if rep.status != 200:
        return False, f"router /readiness {f'HTTP {rep.status}' if rep.status else describe(rep, timeout=timeout)}"
    base = readiness_url.rsplit("/", 1)[0]
    counts = worker_counts(fetch(base + "/workers", timeout))
    missing = [f"{role} {counts.get(role, 0)}/{n}" for role, n in expected if counts.get(role, 0) < n]
    if missing:
        return False, "router sees " + ", ".join(missing)
    return True, "ready"


def worker_counts(rep: Reply) -> dict[str, int]:
    """Healthy prefill/decode counts from sglang-router 0.3.2's GET /workers."""
    if rep.status != 200:
        return {}
    try:
        data: Any = rep.json()
    except ValueError:
        return {}
    items = data.get("workers", data) if isinstance(data, dict) else data
    counts: dict[str, int] = {}
    if isinstance(items, list):
        for w in items:
            if not isinstance(w, dict):
                continue
            if w.get("is_healthy", w.get("healthy", True)) is False:
                continue
            kind = str(w.get("worker_type", w.get("type", ""))).lower()
            for role in ("prefill", "decode"):
                if role in kind:
                    counts[role] = counts.get(role, 0) + 1
    stats = data.get("stats") if isinstance(data, dict) else None
    if isinstance(stats, dict) and not counts:
        for role in ("prefill", "decode"):
            n = stats.get(f"{role}_count")
            if isinstance(n, int):
                counts[role] = n
    return counts


def smoke_text(rep: Reply) -> tuple[str, str]:
    """(generated text, '') on success, ('', why not) otherwise."""
    if rep.status == 200:
        try:
            data = rep.json()
        except ValueError:
            data = {}
        text = data.get("text", "") if isinstance(data, dict) else ""
        if text:
            return text, ""
        return "", f"HTTP 200 without generated text: {rep.body[:200]}"
    return "", f"HTTP {rep.status or 'no answer'}: {(rep.body or rep.error)[:300]}"
