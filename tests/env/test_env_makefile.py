"""The Makefile's `make help` is the developer's map: it lists every target the Makefile declares,
each with its one-line description, and `make clean` removes what the help says it removes
(checked with `make -n`: nothing is deleted here)."""

from __future__ import annotations

import re
import subprocess

from conftest import ROOT

MAKEFILE = ROOT / "Makefile"


def declared_targets() -> list[str]:
    """The .PHONY targets: the commands a developer runs (file targets like .venv/bin/.stamp are not)."""
    phony = next(line for line in MAKEFILE.read_text().splitlines() if line.startswith(".PHONY:"))
    return phony.split(":", 1)[1].split()


def make(*args: str) -> str:
    res = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_make_help_lists_every_declared_target_with_a_description() -> None:
    shown = {}
    for line in make("help").splitlines():
        m = re.match(r"([a-z][a-z-]*)\s{2,}(\S.*)$", line)
        if m:
            shown[m.group(1)] = m.group(2)
    targets = declared_targets()
    assert "clean" in targets
    assert [t for t in targets if t not in shown] == [], shown
    rules = set(re.findall(r"^([a-z][a-z-]*):(?!=)", MAKEFILE.read_text(), flags=re.M))
    assert rules == set(targets), "a rule that is not in .PHONY (or the reverse)"


def test_make_clean_removes_the_cache_and_says_so() -> None:
    dry = make("-n", "clean")
    removed = set(dry.split()[2:]) if dry.startswith("rm -rf ") else set()
    assert {".venv", ".venv-demo", ".cache", "runs", "build", "dist"} <= removed, dry
    help_line = next(line for line in make("help").splitlines() if line.startswith("clean "))
    assert ".cache" in help_line and ".venv" in help_line, help_line


def test_the_readmes_developer_targets_are_the_makefiles() -> None:
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith("Developer targets: "))
    listed = re.search(r"`make ([a-z -]+)`", line)
    assert listed is not None, line
    assert sorted(listed.group(1).split()) == sorted(t for t in declared_targets() if t != "help"), line
