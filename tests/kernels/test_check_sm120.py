"""The sm_120 cross-compile gate, run for real (bundled ptxas, no GPU) in a subprocess.

A subprocess because the kernel tests run with TRITON_INTERPRET=1, under which `triton.jit`
returns interpreter objects that cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from v4flash_kernels.attention.op import SPLIT_CONFIGS, launchable_epilogues
from v4flash_kernels.fp8_gemm.op import launchable as fp8_launchable
from v4flash_kernels.fp8_gemm.op import launchable_gemv as fp8_launchable_gemv
from v4flash_kernels.fp8_gemm.op import launchable_reduce as fp8_launchable_reduce


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    return env


# sm_120 only: the product's GPU, which CI has no card of, so this cross-compile is its only gate. The
# sm_90 binaries (the H200's) are compiled for real by every test of the GPU suite
# (kernels/scripts/gpu_session.sh suite); `python -m v4flash_kernels.check_sm120` does both by default.
ARCHS = (120,)


@pytest.mark.timeout(1200)
def test_check_sm120_passes_on_the_shipped_table(tmp_path):
    # ~190 binaries: ~2.5 min of CPU on a 2-core box
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "v4flash_kernels.check_sm120", *(f"--arch={a}" for a in ARCHS), "--json", str(out)],
        env=_env(tmp_path), capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK:" in proc.stdout
    rows = json.loads(out.read_text())
    split = {(r["config"], r["arch"]) for r in rows if r["kernel"] == "split_kernel"}
    assert split == {(f"{c.name}/e{e}", a) for c in SPLIT_CONFIGS for e in launchable_epilogues(c) for a in ARCHS}
    assert {r["arch"] for r in rows if r["kernel"] == "combine_kernel"} == set(ARCHS)
    fp8 = {(r["config"], r["arch"]) for r in rows if r["kernel"] == "fp8_gemm"}
    assert fp8 == {(b.name, a) for b in fp8_launchable() for a in ARCHS}
    gemv = {(r["config"], r["arch"]) for r in rows if r["kernel"] == "fp8_gemv"}
    assert gemv == {(b.name, a) for b in fp8_launchable_gemv() for a in ARCHS}
    assert len([r for r in rows if r["kernel"] == "fp8_reduce"]) == len(ARCHS) * 2 * len(fp8_launchable_reduce())
    assert len({r["config"] for r in rows if r["kernel"] == "fp8_act_quant"}) == 2
    assert {r["arch"] for r in rows if r["kernel"] == "fp8_act_quant"} == set(ARCHS)
    from v4flash_kernels.mhc.compile import mhc_mix_config
    from v4flash_kernels.mhc.op import DECODE_MAX_TOKENS, launchable, plan_for

    mix = {(r["config"], r["arch"]) for r in rows if r["kernel"] == "mhc_mix"}
    assert mix == {(mhc_mix_config(p, fused, norm), a) for p in launchable() for fused in (False, True)
                   for norm in ({False, p.one_launch}) for a in ARCHS}
    # every decode batch size (one launch) and a prefill size is among them
    for n in (*range(1, DECODE_MAX_TOKENS + 1), 8192):
        p = plan_for(n, 4096, 132)
        assert (mhc_mix_config(p, True, p.one_launch), 120) in mix
    assert {(r["kernel"], r["arch"]) for r in rows if r["kernel"] in ("mhc_finish", "mhc_post")} == {
        (k, a) for k in ("mhc_finish", "mhc_post") for a in ARCHS}
    ar = {(r["config"], r["arch"]) for r in rows if r["kernel"] == "allreduce"}
    from v4flash_kernels.allreduce.plan import WORLDS

    assert ar == {(f"{alg}_shot/n{n}/{dt}", a) for alg in ("one", "two") for n in WORLDS
                  for dt in ("bf16", "fp32", "bf16/probe") for a in ARCHS}
    assert all(r["ptx_problem"] == "" for r in rows if r["kernel"] == "allreduce")
    from v4flash_kernels.qnorm_rope.op import launchable as qnorm_launchable

    assert {(r["config"], r["arch"]) for r in rows if r["kernel"] == "qnorm_rope"} == {
        (c.name, a) for c in qnorm_launchable() for a in ARCHS}
    for r in rows:
        assert r["ok"] and r["spill_stores"] == 0 and r["registers"] > 0
        if r["arch"] == 120:
            assert r["shared_bytes"] <= 101376


@pytest.mark.timeout(600)
def test_check_sm120_rejects_an_oversized_config(tmp_path):
    """64-token tiles need ~147 KB of shared memory: fine on sm_90, over sm_120's 101376 B."""
    code = (
        "from v4flash_kernels.attention.compile import binaries\n"
        "from v4flash_kernels.attention.op import KernelConfig\n"
        "r = [x for x in binaries(120, [KernelConfig(16, 64, 8)]) if x.kernel == 'split_kernel'][0]\n"
        "print(r.shared_bytes, r.ok)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    shared, ok = proc.stdout.split()[-2:]
    assert int(shared) > 101376 and ok == "False"


@pytest.mark.timeout(600)
def test_check_sm120_only_qnorm_rope(tmp_path):
    """`--only qnorm_rope`: every fused q-path binary (the plan's and the sweep's) fits both archs."""
    from v4flash_kernels.qnorm_rope.op import CONFIG, launchable

    out = tmp_path / "q.json"
    proc = subprocess.run([sys.executable, "-m", "v4flash_kernels.check_sm120", "--only", "qnorm_rope", "--json",
                           str(out)], env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert {(r["kernel"], r["config"], r["arch"]) for r in rows} == {
        ("qnorm_rope", c.name, a) for c in launchable() for a in (120, 90)}
    for r in rows:
        assert r["ok"] and r["spill_stores"] == 0 and r["registers"] > 0
    shipped = [r for r in rows if r["config"] == CONFIG.name and r["arch"] == 120]
    assert shipped and shipped[0]["shared_bytes"] <= 101376
