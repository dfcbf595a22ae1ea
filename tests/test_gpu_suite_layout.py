"""The GPU suite is one job: `gpu_session.sh suite` runs `pytest -m gpu tests/kernels`, so every
gpu-marked test must live there (a GPU test elsewhere would never run on the H200)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_MARK = re.compile(r"pytest\.mark\.gpu|mark\.gpu\b")


def test_every_gpu_test_is_under_tests_kernels() -> None:
    outside = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
               if GPU_MARK.search(p.read_text(encoding="utf-8")) and "kernels" not in p.relative_to(ROOT).parts]
    assert not outside, f"gpu-marked tests outside tests/kernels (gpu_session.sh suite would miss them): {outside}"


def test_the_suite_job_runs_every_gpu_test_without_stopping_at_the_first() -> None:
    script = (ROOT / "kernels" / "scripts" / "gpu_session.sh").read_text(encoding="utf-8")
    body = script[script.index("job_suite()"):]
    body = body[:body.index("\n}\n")]
    assert "-m gpu" in body and "tests/kernels" in body and " -x" not in body, body
