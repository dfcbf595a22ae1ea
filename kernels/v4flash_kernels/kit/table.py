"""The one table formatter of the benches (text for the terminal, markdown for the docs), and the
per-row summary every kernel bench's variants table shares."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple


def table(head: Sequence[str], body: Sequence[Sequence[str]], md: bool) -> str:
    """Markdown, or text: the first and last columns left-aligned (the last cut at 70 characters), the
    others right-aligned, two spaces apart, a rule under the head. Every cell is text already."""
    if md:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(out)
    rows: List[Sequence[str]] = [head, *body]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    widths[-1] = min(widths[-1], 70)

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(str(c)[:70].ljust(widths[i]) if i == 0 or i == len(r) - 1 else str(c).rjust(widths[i])
                         for i, c in enumerate(r))

    return "\n".join([fmt(head), "-" * (sum(widths) + 2 * len(widths))] + [fmt(r) for r in body])


def variant_summary(v: Dict[str, Dict[str, Any]]) -> Tuple[float, str, float, float, float, str]:
    """(ours µs, fastest correct variant of ours, its µs, upstream µs, worst rel. err, "  FAIL:..." or "")
    of one row's variants: the columns every kernel bench's table shares."""
    ours = v["ours"]["us"]
    mine = {k: x for k, x in v.items() if k != "upstream" and x["ok"]}
    best_name = min(mine, key=lambda k: mine[k]["us"]) if mine else "-"
    best = mine[best_name]["us"] if mine else float("nan")
    up = v.get("upstream", {}).get("us", float("nan"))
    err = max(x["rel_err"] for k, x in v.items() if k != "upstream")
    bad = "" if all(x["ok"] for x in v.values()) else "  FAIL:" + ",".join(k for k, x in v.items() if not x["ok"])
    return ours, best_name, best, up, err, bad
