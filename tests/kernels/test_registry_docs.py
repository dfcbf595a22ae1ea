"""The documents show the registry as it is: the switch table of README.md, the patch table of
docs/kernel-hook.md and the op table of docs/kernels.md are what tools/registry_docs.py writes from
`hook/patches.py`, and no document names a repository path that does not exist."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("registry_docs", REPO / "tools" / "registry_docs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_tables_are_the_registrys():
    tool = _tool()
    assert tool.stale() == [], "run: python tools/registry_docs.py"
    from v4flash_kernels.hook.patches import PATCHES, SWITCHES

    assert len(tool.switches_table().splitlines()) == 2 + len(SWITCHES)
    assert len(tool.patches_table().splitlines()) == 2 + len(PATCHES)


def test_check_fails_on_a_stale_table_and_the_writer_mends_it(tmp_path):
    tool = _tool()
    for doc in ("README.md", "docs/kernel-hook.md", "docs/kernels.md"):
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / doc, tmp_path / doc)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("| `topk` |", "| `top-k` |"))
    assert tool.main(["--check", "--root", str(tmp_path)]) == 1
    assert tool.main(["--root", str(tmp_path)]) == 0
    assert tool.main(["--check", "--root", str(tmp_path)]) == 0
    assert readme.read_text() == (REPO / "README.md").read_text()


PATH = re.compile(r"(?<![\w/.-])((?:kernels|launcher|tests|tools|docker|docs)/[\w./-]+|"
                  r"v4flash_(?:kernels|bench|pd)/[\w./-]+\.py)")


def test_no_document_names_a_path_that_is_not_there():
    docs = [REPO / "README.md", REPO / "kernels" / "BENCH.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = []
    for doc in docs:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                rel = m.group(1).rstrip(".,)")
                if rel.endswith("_") or re.search(r"[<*{]", line[m.start():m.end() + 1]):
                    continue  # a pattern (`tests/kernels/test_<op>_cpu.py`, `test_launcher_{...}`)
                base = {"v4flash_kernels": "kernels", "v4flash_bench": "kernels", "v4flash_pd": "launcher"}
                root = REPO / base.get(rel.split("/")[0], "")
                if not (root / rel).exists():
                    missing.append(f"{doc.relative_to(REPO)}:{n}: {rel}")
    assert missing == []
