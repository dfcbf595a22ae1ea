"""The one fixed-width table renderer every human-readable report uses (plan, doctor, bench,
topology), so columns line up the same way everywhere and tests parse one format."""

from __future__ import annotations

from typing import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] | range = (),
                 indent: str = "") -> list[str]:
    """Lines of a table: columns two spaces apart, `right` = indices of right-aligned columns,
    trailing blanks stripped. Every cell is text already (callers format numbers their own way)."""
    table = [tuple(header)] + [tuple(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    out = []
    for r in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append((indent + "  ".join(cells)).rstrip())
    return out
