"""The documentation is one web from the README: every docs/*.md can be reached by following
Markdown links from README.md (a doc nothing links to is a doc nobody finds), and every relative
link in the README and the docs points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def relative_links(doc: Path) -> list[Path]:
    """The targets of `[text](path)` links in `doc` that are not URLs, resolved against its directory."""
    return [(doc.parent / t).resolve() for t in LINK.findall(doc.read_text()) if "://" not in t
            and not t.startswith("mailto:")]


def reachable_from_readme() -> set[Path]:
    seen: set[Path] = set()
    todo = [(ROOT / "README.md").resolve()]
    while todo:
        doc = todo.pop()
        if doc in seen or doc.suffix != ".md" or not doc.is_file():
            continue
        seen.add(doc)
        todo += relative_links(doc)
    return seen


def test_every_doc_is_linked_from_the_readme_or_a_doc_it_links() -> None:
    seen = reachable_from_readme()
    orphans = [str(d.relative_to(ROOT)) for d in sorted((ROOT / "docs").glob("*.md")) if d.resolve() not in seen]
    assert orphans == [], f"linked from nowhere: {orphans}"


def test_every_relative_link_points_at_a_file() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [(str(d.relative_to(ROOT)), str(t)) for d in docs for t in relative_links(d) if not t.exists()]
    assert broken == []
