"""A skipped environment test says how to install what it missed (issue 23: the message pointed at
pip for podman and nix, which pip cannot install)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import APT_TOOLS, PIP_TOOLS, ROOT, install_hint

TOOLS = ("uv", "hadolint", "nix", "nix-instantiate", "podman", "runc", "debootstrap")


@pytest.mark.parametrize("tool", TOOLS)
def test_the_hint_names_the_installer_that_has_the_tool(tool: str) -> None:
    hint = install_hint(tool)
    reqs = (ROOT / "tests" / "requirements-env.txt").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    if tool in PIP_TOOLS:
        assert hint.startswith("pip install -r tests/requirements-env.txt"), hint
        assert re.search(rf"^{re.escape(PIP_TOOLS[tool])}==", reqs, re.M), (tool, reqs)
    else:
        assert hint.startswith("apt-get install ") and "pip" not in hint, hint
        assert APT_TOOLS[tool] in ci.split(), (tool, "not in .ci/run's apt-get line")


def test_every_tool_a_test_asks_for_has_a_hint() -> None:
    asked = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        asked |= set(re.findall(r'need_tool\("([a-z-]+)"\)', path.read_text()))
        for group in re.findall(r"for tool in \(([^)]*)\):\s*\n\s*need_tool\(tool\)", path.read_text()):
            asked |= set(re.findall(r'"([a-z-]+)"', group))
    assert asked and asked <= set(PIP_TOOLS) | set(APT_TOOLS), asked - set(PIP_TOOLS) - set(APT_TOOLS)
