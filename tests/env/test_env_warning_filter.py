"""The suite's warning filter hides the Triton interpreter's overflow warnings on masked-off lanes
(issue 23: they filled the test summary) and nothing else: an overflow in a test's own code still
shows. A real pytest run of a tiny interpreted kernel, with the repository's pytest configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

TEST = '''
import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _square(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, x * x, mask=offs < n)


def test_interpreted_kernel_overflowing_in_float32():
    x = torch.full((16,), 1e30, dtype=torch.float32)
    out = torch.empty_like(x)
    _square[(1,)](x, out, 16, BLOCK=16)
    assert torch.isinf(out).all()


def test_own_overflow():
    assert np.isinf(np.float32(1e30) * np.float32(1e30))
'''


def test_only_the_interpreters_overflow_warnings_are_filtered(tmp_path: Path) -> None:
    (tmp_path / "test_tiny.py").write_text(TEST)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    warned = [line for line in res.stdout.splitlines() if "RuntimeWarning: overflow" in line]
    assert warned and all("test_tiny.py" in line for line in warned), res.stdout  # the test's own, not Triton's
    assert "interpreter.py" not in res.stdout, res.stdout
