"""The one result type every doctor check returns, and how a list of them is shown and scored."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from v4flash_pd.table import format_table

OK, WARN, ERROR, SKIP = "ok", "warn", "error", "skip"
STATUSES = (OK, WARN, ERROR, SKIP)
# Exit codes: distinct from the CLI's usage/config error (2) and runtime failure (1), so a script
# can tell "doctor found problems" from "doctor could not run".
EXIT_OK, EXIT_WARN, EXIT_ERROR = 0, 3, 4


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
    """EXIT_OK (0) all ok/skip, EXIT_WARN (3) any warning, EXIT_ERROR (4) any error (errors win)."""
    statuses = {c.status for c in checks}
    if ERROR in statuses:
        return EXIT_ERROR
    if WARN in statuses:
        return EXIT_WARN
    return EXIT_OK


def render_table(checks: Sequence[Check], width: int = 100) -> str:
    """A fixed-width table; each non-ok row is followed by its fix on an indented line."""
    mark = {OK: "ok", WARN: "WARN", ERROR: "ERROR", SKIP: "skip"}
    rows: list[tuple[str, str, str]] = []
    for c in checks:
        rows.append((c.name, mark[c.status], c.detail))
        if c.fix and c.status in (WARN, ERROR):
            rows.append(("", "", f"fix: {c.fix}"))
    lines = format_table(("check", "status", "detail"), rows)
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    lines.append(f"{counts[OK]} ok, {counts[WARN]} warning(s), {counts[ERROR]} error(s), {counts[SKIP]} skipped")
    return "\n".join(lines)


def to_json(checks: Sequence[Check]) -> dict[str, Any]:
    return {"schema": "v4flash-pd.doctor/1", "exit_code": exit_code(checks),
            "checks": [asdict(c) for c in checks]}
