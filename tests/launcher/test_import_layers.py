"""The launcher's modules import one way: no circle (counting imports inside functions too, so none
can hide one), no private name taken from another module, and the config chain in its order.

docs/architecture.md draws the map these rules keep true.
"""

from __future__ import annotations

import ast
from pathlib import Path

import v4flash_pd

ROOT = Path(v4flash_pd.__file__).resolve().parent
PKG = "v4flash_pd"
CONFIG_CHAIN = ("flagwords", "values", "keys", "types", "speculative", "extraargs", "layers", "build", "layout", "load")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """module -> [(imported launcher module, names taken from it)], every import statement."""
    mods = {_module(p): p for p in ROOT.rglob("*.py")}
    out: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for mod, path in mods.items():
        found: list[tuple[str, tuple[str, ...]]] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(a.name, ()) for a in node.names if a.name.startswith(PKG)]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PKG) and not node.level:
                names = tuple(a.name for a in node.names)
                subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in mods]
                found += [(s, ()) for s in subs]  # `from pkg import module`
                rest = tuple(n for n in names if f"{node.module}.{n}" not in mods)
                if rest:
                    found.append((node.module, rest))
        out[mod] = [(m, names) for m, names in found if m in mods and m != mod]
    return out


def _package_faces(graph: dict[str, list[tuple[str, tuple[str, ...]]]]) -> set[str]:
    """Packages whose __init__ only hands names on (doctor, bundle): an import of the package is an
    import of what it re-exports, so the face itself is no node of a circle."""
    return {m for m in graph if (ROOT.parent / m.replace(".", "/") / "__init__.py").is_file()}


def test_no_import_circle() -> None:
    graph = _imports()
    faces = _package_faces(graph)
    edges = {m: {t for t, _ in deps if t not in faces} for m, deps in graph.items() if m not in faces}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_no_private_name_is_imported_from_another_module() -> None:
    taken = [(m, t, n) for m, deps in _imports().items() for t, names in deps for n in names
             if n.startswith("_") and not n.startswith("__")]
    assert taken == []


def test_the_config_chain_imports_only_what_comes_before() -> None:
    graph = _imports()
    for i, name in enumerate(CONFIG_CHAIN):
        deps = {t.rsplit(".", 1)[-1] for t, _ in graph[f"{PKG}.config.{name}"] if t.startswith(f"{PKG}.config.")}
        assert deps <= set(CONFIG_CHAIN[:i]), f"config.{name} imports {sorted(deps - set(CONFIG_CHAIN[:i]))}"
    # nothing below the chain's caller reaches up into plan-level or CLI modules
    for name in CONFIG_CHAIN:
        outside = {t for t, _ in graph[f"{PKG}.config.{name}"] if not t.startswith(f"{PKG}.config")}
        assert outside <= {f"{PKG}.errors", f"{PKG}.ports", f"{PKG}.profiles", f"{PKG}.textfile"}, (name, outside)
