"""The launcher's modules import one way: down the layer table of docs/architecture.md ("The map, top to
bottom"), with no circle (counting imports inside functions too, so none can hide one), no private name
taken from another module, and the config chain in its order.

The table in the document is the one the test reads: a module it does not place, a name it lists that is
no module, or an import up the table fails here.
"""

from __future__ import annotations

from pathlib import Path

import importgraph as G
import v4flash_pd

ROOT = Path(v4flash_pd.__file__).resolve().parent
REPO = Path(__file__).resolve().parents[2]
PKG = "v4flash_pd"
CONFIG_CHAIN = ("flagwords", "values", "keys", "types", "speculative", "extraargs", "layers", "build", "layout", "load")
TABLE = G.layer_table(REPO / "docs" / "architecture.md", "## The map, top to bottom")


def _imports() -> G.Graph:
    return G.imports(ROOT.parent, (PKG,))


def _rel(mod: str) -> str:
    """`v4flash_pd.doctor.p2p` -> `doctor/p2p.py`, as the table names files."""
    path = G.modules(ROOT.parent, (PKG,))[mod]
    return str(path.relative_to(ROOT))


def _package_faces(graph: G.Graph) -> set[str]:
    """Packages whose __init__ only hands names on (doctor, bundle): an import of the package is an
    import of what it re-exports, so the face itself is no node of a circle."""
    return {m for m in graph if (ROOT.parent / m.replace(".", "/") / "__init__.py").is_file()}


def test_no_import_circle() -> None:
    graph = _imports()
    faces = _package_faces(graph)
    edges = {m: {t for t, _ in deps if t not in faces} for m, deps in graph.items() if m not in faces}
    circle = G.find_circle(edges)
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_every_module_is_on_the_map_and_the_map_names_only_modules() -> None:
    rels = [_rel(m) for m in _imports()]
    assert [r for r in rels if G.layer_of(r, TABLE) is None] == [], "modules docs/architecture.md does not place"
    assert G.unused_patterns(rels, TABLE) == [], "docs/architecture.md names what is no module"
    assert [name for name, _ in TABLE][0] == "command line" and TABLE[-1][0] == "ground floor"


def test_no_module_imports_one_above_it() -> None:
    assert G.upward_imports(_imports(), _rel, TABLE) == []


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
