"""The kernel self-check on a real GPU: every patch at production shapes through the launcher's
driver (one process per job, in parallel), timed on a cold and then a warm Triton cache, and
injected failures caught: a wrong result, and a real illegal address that loses the CUDA context
(a fresh process must check the remaining patches).

    PYTHONPATH=launcher:kernels V4FLASH_SELFCHECK_GPU_JSON=out.json python -m pytest -q -m gpu \\
        tests/kernels/test_selfcheck_gpu.py

Two jobs stand for a decode GPU (B=1 and 32, the default profile's largest captured batch, TP4
rank 1) and a prefill GPU (one 8192-token chunk, rank 0) of the default plan, both at
--context-length 131072, sharing the one GPU of the test box. The timings and every record go to
$V4FLASH_SELFCHECK_GPU_JSON when set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from v4flash_pd.selfcheck import result
from v4flash_pd.selfcheck.driver import run_jobs
from v4flash_pd.selfcheck.jobs import Job

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

PATCHES = ("sparse_decode", "moe", "indexer")
RESULTS: dict = {}


def _job(name: str, role: str, patches: tuple[str, ...], *args: str) -> Job:
    argv = (sys.executable, "-m", "v4flash_kernels.selfcheck", "--gpu", "0", "--patches", ",".join(patches),
            "--context", "131072", "--tp-size", "4", *args, "--device", "cuda")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return Job(0, name, role, argv, (("CUDA_VISIBLE_DEVICES", visible), ("PYTHONUNBUFFERED", "1")), patches)


DECODE = _job("decode", "decode", PATCHES, "--batches", "1,32", "--prefill-rows", "0", "--tp-rank", "1")
PREFILL = _job("prefill", "prefill", PATCHES, "--batches", "1", "--prefill-rows", "8192", "--tp-rank", "0")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("triton-cache")


def _run(jobs, tmp: Path, cache: Path, extra_env: dict | None = None) -> tuple[dict, float]:
    env = dict(os.environ)
    env.pop("V4FLASH_SELFCHECK_INJECT", None)
    env.update({"TRITON_CACHE_DIR": str(cache), **(extra_env or {})})
    t0 = time.monotonic()
    gpus = run_jobs(tuple(jobs), tmp, env, echo=lambda m: print(m, flush=True))
    seconds = time.monotonic() - t0
    return result.summarize(gpus, PATCHES, seconds), seconds


def _save() -> None:
    path = os.environ.get("V4FLASH_SELFCHECK_GPU_JSON")
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")


def test_every_patch_passes_at_production_shapes_cold_then_warm(tmp_path, cache):
    cold, t_cold = _run([DECODE, PREFILL], tmp_path / "cold", cache)
    RESULTS["cold"] = {"seconds": round(t_cold, 1), "summary": cold}
    _save()
    print(result.render(cold))
    assert not result.failed(cold), result.render(cold)
    for g in cold["gpus"]:
        for name in PATCHES:
            cases = g["patches"][name]["cases"]
            assert any(c["size"] == "production" for c in cases), (g["worker"], name)
            assert all(c["status"] == "pass" for c in cases)
    graphs = [c["graph"] for g in cold["gpus"] for p in g["patches"].values() for c in p["cases"] if c.get("graph")]
    assert graphs and all(x["status"] == "pass" and x["replays"] == 2 for x in graphs)
    warm, t_warm = _run([DECODE, PREFILL], tmp_path / "warm", cache)
    RESULTS["warm"] = {"seconds": round(t_warm, 1), "summary": warm}
    _save()
    print(f"self-check, 2 jobs x 3 patches on one GPU: cold Triton cache {t_cold:.1f}s, warm {t_warm:.1f}s")
    assert not result.failed(warm)
    assert t_warm < t_cold, "a warm Triton cache must not compile again"


def test_injected_failures_are_caught_and_the_rest_still_checked(tmp_path, cache):
    """sparse_decode stores through a wild address (a sticky CUDA error: the process is useless from
    there), moe returns wrong numbers; a fresh process must still check moe and indexer."""
    summary, seconds = _run([DECODE], tmp_path, cache, {"V4FLASH_SELFCHECK_INJECT": "sparse_decode:launch,moe:wrong"})
    RESULTS["injected"] = {"seconds": round(seconds, 1), "summary": summary}
    _save()
    print(result.render(summary))
    p = summary["patches"]
    assert p["sparse_decode"]["status"] == "fail" and p["sparse_decode"]["class"] == "launch_error", p["sparse_decode"]
    assert p["moe"]["status"] == "fail" and p["moe"]["class"] == "wrong_result", p["moe"]
    assert p["indexer"]["status"] == "pass", p["indexer"]
    assert summary["gpus"][0]["attempts"] == 2, "the lost context must have been replaced by a fresh process"
