"""The kernels' two packages import one way: down the kernels' table of docs/architecture.md ("The
kernels: the map, top to bottom"), no circle but the one the document names, no private name taken from
another module, no op folder importing another, and nothing that serves importing the benches.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import importgraph as G

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "kernels"
PACKAGES = ("v4flash_kernels", "v4flash_bench")
TABLE = G.layer_table(REPO / "docs" / "architecture.md", "## The kernels: the map, top to bottom")
# The deliberate pair (docs/architecture.md says why): the .pth's boot module loads the hook inside a
# function when SGLang imports a target module; the hook installs the boot module's finder.
DEFERRED = ("v4flash_kernels.hook.hook_boot", "v4flash_kernels.hook.hook")
OP_FOLDERS = {p.split("/")[1] for _, pats in TABLE for p in pats if p.count("/") == 2 and p.endswith("/")
              and p.startswith("v4flash_kernels/")} - {"kit"}


def _graph() -> G.Graph:
    return G.imports(ROOT, PACKAGES)


def _rel(mod: str) -> str:
    return str(G.modules(ROOT, PACKAGES)[mod].relative_to(ROOT))


def test_no_import_circle_but_the_hooks_deferred_pair() -> None:
    edges = {m: {t for t, _ in deps} for m, deps in _graph().items()}
    boot, hook = DEFERRED
    assert hook in edges[boot] and boot in edges[hook], "the allowed pair is gone: drop it here and in the doc"
    edges[boot].discard(hook)
    circle = G.find_circle(edges)
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_every_module_is_on_the_map_and_the_map_names_only_modules() -> None:
    rels = [_rel(m) for m in _graph()]
    assert [r for r in rels if G.layer_of(r, TABLE) is None] == [], "modules docs/architecture.md does not place"
    assert G.unused_patterns(rels, TABLE) == [], "docs/architecture.md names what is no module"
    assert TABLE[-1][0] == "ground floor" and "op folders" in [name for name, _ in TABLE]


def test_no_module_imports_one_above_it() -> None:
    assert G.upward_imports(_graph(), _rel, TABLE) == []


def test_no_op_folder_imports_another() -> None:
    def folder(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[1] if parts[0] == "v4flash_kernels" and len(parts) > 2 and parts[1] in OP_FOLDERS else None

    from v4flash_kernels.hook.patches import SWITCHES

    # a fusion may import the public `op` module of each op its registry entry says it fuses, nothing else
    fused = {s.compile.split(".")[1]: set(s.fuses) for s in SWITCHES if s.compile}
    assert OP_FOLDERS >= {"attention", "moe", "indexer", "fp8_gemm", "mhc", "topk", "allreduce"}
    crossing = [(m, t) for m, deps in _graph().items() for t, _ in deps
                if folder(m) is not None and folder(t) is not None and folder(m) != folder(t)
                and not (folder(t) in fused.get(folder(m) or "", set()) and t == f"v4flash_kernels.{folder(t)}.op")]
    assert crossing == []


def test_no_private_name_is_imported_from_another_module() -> None:
    taken = [(m, t, n) for m, deps in _graph().items() for t, names in deps for n in names
             if n.startswith("_") and not n.startswith("__")]
    assert taken == []


def test_what_serves_never_loads_the_benches() -> None:
    """Importing the hook, every op module and the self-check (as a worker and `up` do) loads nothing of
    v4flash_bench: in a fresh interpreter, with the modules' own imports, not just the source's."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import v4flash_kernels\n"
        "names = [m.name for m in pkgutil.walk_packages(v4flash_kernels.__path__, 'v4flash_kernels.')]\n"
        "for n in names:\n"
        "    importlib.import_module(n)\n"
        "bench = sorted(m for m in sys.modules if m.split('.')[0] == 'v4flash_bench')\n"
        "print(len(names), bench)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr
    count, bench = out.stdout.split(" ", 1)
    assert int(count) > 60 and bench.strip() == "[]"
