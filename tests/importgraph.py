"""Who imports whom, read from the source (every import statement, inside functions too), and the layer
table of docs/architecture.md that both packages' import tests hold the code to.

A layer table is a markdown table under a heading: the first column names the layer, the second lists
its modules in backticks (`cli/main.py`, a folder `doctor/`, a pattern `cli/cmd_<name>.py`); rows run
from the top floor down, and a module may import only modules of its own row or a row below.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path
from typing import Callable

Graph = dict[str, list[tuple[str, tuple[str, ...]]]]


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for the packages directly under `root`."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(root: Path, packages: tuple[str, ...]) -> Graph:
    """module -> [(imported module of these packages, names taken from it)], every import statement."""
    mods = modules(root, packages)
    out: Graph = {}
    for mod, path in mods.items():
        found: list[tuple[str, tuple[str, ...]]] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(a.name, ()) for a in node.names if a.name.split(".")[0] in packages]
            elif (isinstance(node, ast.ImportFrom) and node.module and not node.level
                  and node.module.split(".")[0] in packages):
                names = tuple(a.name for a in node.names)
                subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in mods]
                found += [(s, ()) for s in subs]  # `from pkg import module`
                rest = tuple(n for n in names if f"{node.module}.{n}" not in mods)
                if rest:
                    found.append((node.module, rest))
        out[mod] = [(m, names) for m, names in found if m in mods and m != mod]
    return out


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)) is not None:
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def layer_table(doc: Path, heading: str) -> list[tuple[str, list[str]]]:
    """(layer, module patterns) per row of the first table under `heading`, top floor first."""
    text = doc.read_text()
    start = text.index(heading)
    rows: list[tuple[str, list[str]]] = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| layer"):
            if rows and not line.strip():
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        patterns = [t for t in re.findall(r"`([^`]+)`", cells[1]) if t.endswith((".py", "/"))]
        rows.append((cells[0], patterns))
    return rows


def _matches(rel: str, pattern: str) -> bool:
    if pattern.endswith("/"):
        return rel.startswith(pattern)
    return fnmatch.fnmatchcase(rel, re.sub(r"<[^>]+>", "*", pattern))


def layer_of(rel: str, table: list[tuple[str, list[str]]]) -> int | None:
    """The row index of a module's file (path relative to the table's root): a file pattern wins over a
    folder, a deeper folder over a shallower one."""
    best: tuple[int, int] | None = None
    for i, (_, patterns) in enumerate(table):
        for p in patterns:
            if _matches(rel, p):
                rank = 10_000 if not p.endswith("/") else p.count("/")
                if best is None or rank > best[0]:
                    best = (rank, i)
    return None if best is None else best[1]


def unused_patterns(rels: list[str], table: list[tuple[str, list[str]]]) -> list[str]:
    """Patterns of the table that name no module (a stale map)."""
    return [p for _, patterns in table for p in patterns if not any(_matches(r, p) for r in rels)]


def upward_imports(graph: Graph, rel: Callable[[str], str], table: list[tuple[str, list[str]]]) -> list[str]:
    """Every import of a module from a row above its own, as "file (row) -> file (row)"."""
    up = []
    for mod, deps in graph.items():
        here = layer_of(rel(mod), table)
        for target, _ in deps:
            there = layer_of(rel(target), table)
            if here is not None and there is not None and there < here:
                up.append(f"{rel(mod)} ({table[here][0]}) -> {rel(target)} ({table[there][0]})")
    return up
