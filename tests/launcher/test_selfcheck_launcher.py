"""The kernel self-check from the launcher's side, without a GPU: one job per GPU from the plan,
the driver against the rehearsal stand-in (every way a check process can end: pass, a failed patch,
a lost CUDA context, a crash, a hang, an interpreter that does not exist, a refusal), the merged
verdict, `v4flash-pd selfcheck` and `doctor --gpu`, and every bad input as one error + fix."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import fakebox
import pytest

from v4flash_kernels.hook.patches import SWITCHES as REGISTRY
from v4flash_pd import topology as topo
from v4flash_pd.config.load import load_config
from v4flash_pd.host import Host
from v4flash_pd.plan import build_plan
from v4flash_pd.selfcheck import result
from v4flash_pd.selfcheck.driver import Interrupted, run_jobs
from v4flash_pd.selfcheck.jobs import KERNEL_MODULE, STANDIN_MODULE, Job, arg, jobs_for, shapes

FIXTURES = Path(__file__).parent / "fixtures"
PATCHES = ("sparse_decode", "moe", "indexer")  # the switches with a self-check (stand-in jobs check these)
SWITCHES = tuple(s.name for s in REGISTRY if s.default_on)  # every switch the default plan turns on
INJECT = "V4FLASH_SELFCHECK_INJECT"


def plan_of(*sets: str, profile: str | None = None, rehearse: bool = False):
    cfg = load_config(profile=profile, env={}, sets=(f"python={sys.executable}", *sets))
    return build_plan(cfg, Host.remote(topo.load(FIXTURES / "topology-8gpu-2node.json")), rehearse=rehearse)


def env(**extra: str) -> dict[str, str]:
    e = fakebox.clean_env()
    e.update(extra)
    return e


def standin_job(gpu: int, patches=PATCHES, python: str = sys.executable) -> Job:
    argv = (python, "-m", STANDIN_MODULE, "--gpu", str(gpu), "--patches", ",".join(patches), "--device", "cuda")
    return Job(gpu, "decode-0", "decode", argv, (("CUDA_VISIBLE_DEVICES", str(gpu)),), tuple(patches))


def quiet(_m: str) -> None:
    return None


# ------------------------------------------------------------------ jobs: pure, from the plan


def test_one_job_per_gpu_with_the_workers_env_shapes_and_interpreter():
    plan = plan_of()
    jobs = jobs_for(plan, SWITCHES, {"V4FLASH_CACHE_DIR": "/var/cache/v4flash"})
    assert [j.gpu for j in jobs] == list(range(8))
    worker = {p.name: p for p in plan.workers()}
    for j in jobs:
        spec = worker[j.worker]
        e = dict(j.env)
        assert e["CUDA_VISIBLE_DEVICES"] == str(j.gpu)
        assert {k: v for k, v in spec.env if k.startswith("V4FLASH_")}.items() <= e.items()
        assert e["TRITON_CACHE_DIR"] == "/var/cache/v4flash/triton"
        assert j.argv[:3] == (sys.executable, "-m", KERNEL_MODULE)
        assert arg(j.argv, "--patches") == ",".join(SWITCHES) and arg(j.argv, "--gpu") == str(j.gpu)
        assert arg(j.argv, "--context") == "131072" and arg(j.argv, "--tp-size") == "4"
        assert arg(j.argv, "--tp-rank") == str(spec.gpus.index(j.gpu))
        assert j.group == spec.name, "a TP4 worker's GPUs meet for the checks that span them"
        if j.role == "decode":  # the profile's largest captured batch; decode workers never prefill
            assert arg(j.argv, "--batches") == "1,64" and arg(j.argv, "--prefill-rows") == "0"
            # MTP on (2 draft steps): the verify graphs hold B x 3 rows at the fewest and most requests
            assert arg(j.argv, "--verify-rows") == "3,192"
        else:  # one 8192-token chunk; prefill workers run no decode graphs
            assert arg(j.argv, "--batches") == "1" and arg(j.argv, "--prefill-rows") == "8192"
            assert arg(j.argv, "--verify-rows") is None


def test_unset_shapes_take_sglangs_defaults_and_a_given_cache_dir_wins():
    plan = plan_of()
    decode = next(p for p in plan.workers() if p.role == "decode")
    drop = {"--cuda-graph-max-bs", "--context-length"}
    argv = [a for i, a in enumerate(decode.argv) if a not in drop and decode.argv[i - 1] not in drop]
    s = shapes(replace(decode, argv=tuple(argv)))
    assert s.batches == (1, 512) and s.context == 1 << 20 and s.prefill_rows == 0 and s.tp_size == 4
    j = next(j for j in jobs_for(plan, PATCHES, {"TRITON_CACHE_DIR": "/x", "V4FLASH_CACHE_DIR": "/c"}))
    assert "TRITON_CACHE_DIR" not in dict(j.env), "the launcher's own TRITON_CACHE_DIR reaches the child as is"


def test_rehearsal_runs_the_standin_and_cpu_the_real_kernels():
    plan = plan_of(rehearse=True)
    assert jobs_for(plan, PATCHES, {}, standin=True)[0].argv[2] == STANDIN_MODULE
    assert arg(jobs_for(plan, PATCHES, {}, device="cpu")[0].argv, "--device") == "cpu"


def test_with_patches_keeps_everything_else():
    j = standin_job(3)
    k = j.with_patches(("indexer",))
    assert k.patches == ("indexer",) and arg(k.argv, "--patches") == "indexer"
    assert k.env == j.env and arg(k.argv, "--gpu") == "3"


# ------------------------------------------------------------------ the driver, against the stand-in


def test_all_pass(tmp_path):
    gpus = run_jobs((standin_job(0), standin_job(1)), tmp_path, env(), quiet)
    s = result.summarize(gpus, PATCHES, 1.0)
    assert not result.failed(s) and s["standin"]
    assert all(g["attempts"] == 1 and g["patches"][p]["status"] == "pass" for g in gpus for p in PATCHES)
    assert (tmp_path / "selfcheck-gpu0.log").exists()


def test_a_failure_on_one_gpu_fails_the_patch_and_names_gpu_class_and_error(tmp_path):
    gpus = run_jobs((standin_job(4), standin_job(5)), tmp_path, env(**{INJECT: "moe:wrong@5"}), quiet)
    s = result.summarize(gpus, PATCHES, 1.0)
    assert result.failed(s) == ["moe"]
    moe = s["patches"]["moe"]
    assert moe["failed_gpus"] == [5] and moe["class"] == "wrong_result" and moe["where"] == "GPU 5 (decode-0)"
    assert moe["gpus"] == {"4": "pass", "5": "fail"}
    line = result.warnings(s, "switched OFF")[0]
    assert "moe" in line and "GPU 5" in line and "wrong_result" in line and "rel. error" in line


@pytest.mark.parametrize("kind, cls", [("launch", "launch_error"), ("crash", "crash")])
def test_a_lost_context_or_a_crash_fails_that_patch_and_a_fresh_process_checks_the_rest(tmp_path, kind, cls):
    gpus = run_jobs((standin_job(2),), tmp_path, env(**{INJECT: f"sparse_decode:{kind}"}), quiet)
    g = gpus[0]
    assert g["attempts"] == 2, g
    assert g["patches"]["sparse_decode"]["status"] == "fail" and g["patches"]["sparse_decode"]["class"] == cls
    assert g["patches"]["moe"]["status"] == "pass" and g["patches"]["indexer"]["status"] == "pass"


def test_a_hang_is_killed_after_the_case_timeout(tmp_path):
    t0 = time.monotonic()
    gpus = run_jobs((standin_job(1),), tmp_path, env(**{INJECT: "moe:hang"}), quiet, timeout=1.0)
    assert time.monotonic() - t0 < 30
    moe = gpus[0]["patches"]["moe"]
    assert moe["class"] == "timeout" and "no progress for 1s" in moe["error"] and "moe / stand-in" in moe["error"]
    assert gpus[0]["patches"]["sparse_decode"]["status"] == "pass"
    assert gpus[0]["patches"]["indexer"]["status"] == "pass", "the rest must be checked by a fresh process"


def test_an_interpreter_that_does_not_exist_fails_every_patch_once(tmp_path):
    gpus = run_jobs((standin_job(0, python=str(tmp_path / "no-python")),), tmp_path, env(), quiet)
    g = gpus[0]
    assert g["attempts"] == 1
    assert all(g["patches"][p]["status"] == "fail" for p in PATCHES)
    assert "could not be started" in g["patches"]["sparse_decode"]["error"]


def test_a_check_process_that_refuses_fails_every_patch_as_harness_error(tmp_path):
    gpus = run_jobs((standin_job(0),), tmp_path, env(**{INJECT: "moe:melt"}), quiet)
    p = gpus[0]["patches"]["moe"]
    assert p["class"] == "harness_error" and "PATCH:KIND" in p["error"]


def test_sigterm_during_the_check_kills_the_children(tmp_path):
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(Interrupted):
            run_jobs((standin_job(0),), tmp_path, env(**{INJECT: "sparse_decode:hang"}), quiet, timeout=60)
    finally:
        timer.cancel()
    rec = json.loads((tmp_path / "selfcheck-gpu0.try1.json").read_text())
    assert rec["running"]["patch"] == "sparse_decode"
    with pytest.raises(ProcessLookupError):
        os.kill(rec["pid"], 0)


def test_a_signal_while_a_check_process_is_being_created_still_kills_it(tmp_path, monkeypatch):
    """SIGTERM arriving inside `subprocess.Popen` (after the fork, before it returns) must not orphan the
    child: it is held until the driver holds the child, then the child is killed and `Interrupted` raised."""
    from v4flash_pd.selfcheck import driver

    real_popen = driver.subprocess.Popen
    made: list = []

    def popen_then_signal(*a, **kw):
        child = real_popen(*a, **kw)
        made.append(child)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered before this returns: Python runs handlers promptly
        for _ in range(1000):
            time.sleep(0.001)
        return child

    monkeypatch.setattr(driver.subprocess, "Popen", popen_then_signal)
    try:
        with pytest.raises(Interrupted):
            run_jobs((standin_job(0),), tmp_path, env(**{INJECT: "sparse_decode:hang"}), quiet, timeout=60)
        assert len(made) == 1
        assert made[0].poll() is not None, "the check process outlived the self-check"
    finally:
        for child in made:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(10)


def test_load_refuses_what_is_not_a_result(tmp_path):
    for text, words in (("{", "not JSON"), ("[]", "not a v4flash-pd self-check result"),
                        (json.dumps({"schema": result.SCHEMA}), "incomplete")):
        (tmp_path / "s.json").write_text(text)
        with pytest.raises(ValueError, match=words):
            result.load(tmp_path / "s.json")
    with pytest.raises(ValueError, match="cannot read"):
        result.load(tmp_path / "missing.json")


def test_gpu_ranges():
    assert result.gpu_ranges([0, 1, 2, 3, 5, 7, 6]) == "0-3,5-7" and result.gpu_ranges([]) == "-"


# ------------------------------------------------------------------ `v4flash-pd selfcheck`, `doctor --gpu`


def test_selfcheck_command_in_rehearsal_is_marked_stand_in(cli, tmp_path):
    res = cli("selfcheck", "--rehearse", "--out", str(tmp_path / "sc"))
    assert res.returncode == 0, res.stderr
    assert "all passed" in res.stdout and "[stand-in: rehearsal, no kernel ran]" in res.stdout
    s = result.load(tmp_path / "sc" / "selfcheck.json")
    assert s["standin"] and s["decision"] == "checked" and len(s["gpus"]) == 8
    assert s["requested"] == list(SWITCHES)
    assert all(g["patches"]["moe"]["cases"][0]["name"] == "stand-in" for g in s["gpus"])
    assert all(sw.name not in s["patches"] for sw in REGISTRY if not sw.default_on)  # off: not checked
    for sw in (sw for sw in REGISTRY if sw.default_on):  # a switch without a self-check is never vouched for
        assert s["patches"][sw.name]["status"] == ("pass" if sw.selfcheck else "unchecked"), sw.name
        assert (f"WARNING kernel patch {sw.name} has no self-check" in res.stderr) == (sw.selfcheck is None)


def test_selfcheck_command_reports_a_failure_and_exits_1(cli, tmp_path):
    res = cli("selfcheck", "--rehearse", "--json", "--out", str(tmp_path / "sc"),
              extra_env={INJECT: "indexer:compile@6"})
    assert res.returncode == 1
    data = json.loads(res.stdout)
    assert data["patches"]["indexer"]["class"] == "compile_error" and data["patches"]["indexer"]["failed_gpus"] == [6]
    assert "WARNING kernel patch indexer FAILED" in res.stderr and "GPU 6" in res.stderr
    assert "error: kernel self-check failed for indexer" in res.stderr and "fix: " in res.stderr


@pytest.mark.parametrize("args, words", [
    (["--no-selfcheck"], "--no-selfcheck skips the very thing"),
    ([a for s in REGISTRY for a in (s.flag, "off")], "nothing to check"),
    (["--out", "/proc/v4flash-no"], "cannot write the self-check's directory"),
])
def test_selfcheck_bad_input(cli, args, words):
    res = cli("selfcheck", "--rehearse", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: ") and "fix: " in res.stderr and words in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("var, value, words", [
    ("V4FLASH_SELFCHECK_DEVICE", "tpu", "is not cuda or cpu"),
    ("V4FLASH_SELFCHECK_INJECT", "moe:melt", "PATCH:KIND"),
    ("V4FLASH_SELFCHECK_CASE_TIMEOUT", "soon", "not a positive number"),
    ("V4FLASH_SELFCHECK_CASE_TIMEOUT", "-1", "not a positive number"),
])
def test_a_malformed_seam_is_refused_before_anything_runs(cli, tmp_path, var, value, words):
    res = cli("selfcheck", "--rehearse", "--out", str(tmp_path / "sc"), extra_env={var: value})
    assert res.returncode == 2 and words in res.stderr and "fix: " in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "sc" / "selfcheck").exists()


def test_selfcheck_refuses_a_box_without_the_plans_gpus(cli, tmp_path):
    e = fakebox.box_env(tmp_path, fakebox.BOX_4GPU_1NODE)
    res = cli("selfcheck", "--out", str(tmp_path / "sc"), env=e)
    assert res.returncode == 2 and "the plan uses GPUs [0, 1, 2, 3, 4, 5, 6, 7] but this box has [0, 1, 2, 3]" \
        in res.stderr and "fix: " in res.stderr and "Traceback" not in res.stderr


def test_doctor_gpu_rows(cli, tmp_path):
    ok = cli("doctor", "--rehearse", "--gpu", "--only", "offline", "--json")
    rows = {c["name"]: c for c in json.loads(ok.stdout)["checks"]}
    assert {f"selfcheck-{p}" for p in PATCHES} <= set(rows)
    assert all(rows[f"selfcheck-{p}"]["status"] == "ok" and "stand-in" in rows[f"selfcheck-{p}"]["detail"]
               for p in PATCHES)
    bad = cli("doctor", "--rehearse", "--gpu", "--only", "offline", extra_env={INJECT: "moe:resource@1"})
    assert bad.returncode == 4, bad.stdout
    assert "selfcheck-moe" in bad.stdout and "resource_error" in bad.stdout and "GPU 1" in bad.stdout
    assert "switches this patch off" in bad.stdout
    plain = cli("doctor", "--rehearse", "--only", "offline", "--json")
    assert not any(c["name"].startswith("selfcheck") for c in json.loads(plain.stdout)["checks"])
