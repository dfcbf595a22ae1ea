"""Suite-wide fixtures. Area fixtures live in each tests/<area>/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import sglang_env


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    return sglang_env.sglang_python()
