"""Fixtures for launcher-core tests: fake boxes (via tests/fakebox.py) and a real-subprocess CLI runner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # tests/fakebox.py is shared with other areas (doctor)
    sys.path.insert(0, str(TESTS))

import fakebox  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def run_cli(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    """`v4flash-pd ARGS` as a real process, with V4FLASH_* from the developer's shell removed."""
    return subprocess.run([sys.executable, "-m", "v4flash_pd", *args], capture_output=True, text=True,
                          env=env if env is not None else fakebox.clean_env(), cwd=cwd, timeout=timeout)


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    def call(*args: str, env: dict[str, str] | None = None, extra_env: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess:
        e = dict(env if env is not None else fakebox.clean_env())
        e.update(extra_env or {})
        return run_cli(list(args), e, tmp_path, timeout)

    return call


@pytest.fixture
def plan_json(cli: Callable[..., subprocess.CompletedProcess]) -> Callable[..., dict]:
    """`plan --json ARGS` that must succeed; returns the parsed plan."""

    def call(*args: str, **kw: object) -> dict:
        res = cli("plan", "--json", *args, **kw)
        assert res.returncode == 0, f"plan failed (rc {res.returncode}):\n{res.stderr}"
        return json.loads(res.stdout)

    return call


@pytest.fixture
def topo_8x2() -> Path:
    """8 GPUs on 2 NUMA nodes: GPUs 0-3 on node 0, 4-7 on node 1 (the reference box)."""
    return FIXTURES / "topology-8gpu-2node.json"


@pytest.fixture
def topo_4x1() -> Path:
    """4 GPUs, one NUMA node."""
    return FIXTURES / "topology-4gpu-1node.json"


@pytest.fixture
def topo_swapped() -> Path:
    """8 GPUs whose NUMA map contradicts the profile: GPUs 0-3 on node 1, 4-7 on node 0."""
    return FIXTURES / "topology-8gpu-swapped.json"
