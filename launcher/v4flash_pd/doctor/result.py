"""The one result type every doctor check returns, and how a list of them is shown and scored."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

OK, WARN, ERROR, SKIP = "ok", "warn", "error", "skip"
STATUSES = (OK, WARN, ERROR, SKIP)


@dataclass(frozen=True)
class Check:
    """One finding: `detail` says what was seen, `fix` what to do about it (empty when ok/skip)."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"bad check status {self.status!r}")


def ok(name: str, detail: str) -> Check:
    return Check(name, OK, detail)


def warn(name: str, detail: str, fix: str) -> Check:
    return Check(name, WARN, detail, fix)


def error(name: str, detail: str, fix: str) -> Check:
    return Check(name, ERROR, detail, fix)


def skip(name: str, reason: str) -> Check:
    return Check(name, SKIP, reason)


def exit_code(checks: Iterable[Check]) -> int:
    """0 all ok/skip, 1 any warning, 2 any error (errors win)."""
    statuses = {c.status for c in checks}
    if ERROR in statuses:
        return 2
    if WARN in statuses:
        return 1
    return 0


def render_table(checks: Sequence[Check], width: int = 100) -> str:
    """A fixed-width table; each non-ok row is followed by its fix on an indented line."""
    mark = {OK: "ok", WARN: "WARN", ERROR: "ERROR", SKIP: "skip"}
    name_w = max([len(c.name) for c in checks] + [5])
    lines = [f"{'check'.ljust(name_w)}  status  detail"]
    for c in checks:
        lines.append(f"{c.name.ljust(name_w)}  {mark[c.status].ljust(6)}  {c.detail}")
        if c.fix and c.status in (WARN, ERROR):
            lines.append(f"{''.ljust(name_w)}  {'':6}  fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    lines.append(f"{counts[OK]} ok, {counts[WARN]} warning(s), {counts[ERROR]} error(s), {counts[SKIP]} skipped")
    return "\n".join(lines)


def to_json(checks: Sequence[Check]) -> dict:
    return {"schema": "v4flash-pd.doctor/1", "exit_code": exit_code(checks),
            "checks": [asdict(c) for c in checks]}
