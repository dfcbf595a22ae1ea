"""`up` runs the kernel self-check before any worker starts (rehearsal: the stand-in; with
V4FLASH_SELFCHECK_DEVICE=cpu the real kernels under Triton's interpreter), switches a failing
patch off through the plan (plan.json and every worker's V4FLASH_<PATCH>=0), refuses with
--strict-selfcheck before starting anything, skips with --no-selfcheck; `status` shows it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fakebox
import pytest

from v4flash_kernels.hook.patches import SWITCHES as REGISTRY

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl not installed (CI installs it)")]

INJECT = "V4FLASH_SELFCHECK_INJECT"
ALL = tuple(s.name for s in REGISTRY)
SWITCHES = tuple(s.name for s in REGISTRY if s.default_on)  # what the default plan turns on (allreduce once checked)


@pytest.fixture()
def box(tmp_path: Path) -> dict:
    ports = fakebox.free_ports(7)
    env = fakebox.clean_env()
    env.update({"V4FLASH_RUNS_ROOT": str(tmp_path / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.3",
                "V4FLASH_GRACE": "5"})
    return {"tmp": tmp_path, "env": env, "ports": ports, "cfg": fakebox.write_pd_config(tmp_path, ports),
            "topology": fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)}


def v4(box: dict, *args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    env = dict(box["env"], **extra)
    return subprocess.run([sys.executable, "-m", "v4flash_pd", *args], capture_output=True, text=True, env=env,
                          cwd=box["tmp"], timeout=timeout)


def up(box: dict, *args: str, config: bool = True, **extra: str) -> subprocess.CompletedProcess:
    cfg = ("--config", str(box["cfg"])) if config else ()
    return v4(box, "up", "--rehearse", *cfg, "--topology", str(box["topology"]), *args, **extra)


def latest(box: dict) -> Path:
    return (box["tmp"] / "runs" / "latest").resolve()


def worker_switches(run: Path) -> dict[str, dict[str, str]]:
    plan = json.loads((run / "plan.json").read_text())
    return {p["name"]: {k: v for k, v in p["env"] if k.startswith("V4FLASH_") and k != "V4FLASH_REHEARSAL"}
            for p in plan["processes"] if p["role"] != "router"}


@pytest.fixture()
def stopper(box):
    yield
    if (box["tmp"] / "runs" / "latest").exists():
        v4(box, "down", "--run-dir", str(latest(box)))


def test_a_failing_patch_is_switched_off_through_the_plan(box, stopper):
    res = up(box, "--detach", **{INJECT: "moe:wrong@5"})
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert out.index("kernel self-check") < out.index("launcher detached"), "the check runs before anything starts"
    warning = next(line for line in out.splitlines() if line.startswith("WARNING kernel patch moe"))
    assert "GPU 5" in warning and "wrong_result" in warning and "switched OFF for this run" in warning
    run = latest(box)
    plan = json.loads((run / "plan.json").read_text())
    assert dict(map(tuple, plan["patches"])) == {n: n != "moe" and n in SWITCHES for n in ALL}
    for name, sw in worker_switches(run).items():
        assert sw == {f"V4FLASH_{n.upper()}": "0" if n == "moe" or n not in SWITCHES else "1" for n in ALL}, name
    s = json.loads((run / "selfcheck.json").read_text())
    assert s["decision"] == "switched_off" and s["switched_off"] == ["moe"] and s["standin"]
    # the detached launcher runs the plan it was handed (moe off): it never checks again
    assert "kernel self-check" not in (run / "launcher.log").read_text()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    first_start = next(i for i, e in enumerate(events) if e["event"] == "start")
    checks = [i for i, e in enumerate(events) if e["event"] == "selfcheck"]
    assert len(checks) == 1 and checks[0] < first_start
    st = v4(box, "status", "--run-dir", str(run))
    assert "moe FAILED on GPU 5" in st.stdout and "switched off for this run" in st.stdout
    js = json.loads(v4(box, "status", "--json", "--run-dir", str(run)).stdout)
    assert js["selfcheck"]["switched_off"] == ["moe"] and js["selfcheck"]["standin"]


def test_all_pass_changes_nothing_and_is_marked_stand_in(box, stopper):
    res = up(box, "--detach")
    assert res.returncode == 0, res.stderr
    assert "all passed" in res.stdout and "[stand-in: rehearsal, no kernel ran]" in res.stdout
    assert "FAILED" not in res.stdout
    # every patch on by default is on, the auto all-reduce too (its own check passed); the others stay off
    assert all(sw == {f"V4FLASH_{n.upper()}": "1" if n in SWITCHES else "0" for n in ALL}
               for sw in worker_switches(latest(box)).values())


def test_strict_refuses_before_any_worker_starts(box):
    res = up(box, "--strict-selfcheck", **{INJECT: "indexer:launch@0"})
    assert res.returncode == 1
    assert "error: kernel self-check failed for indexer (launch_error" in res.stderr and "--strict-selfcheck" \
        in res.stderr and "fix: " in res.stderr and "Traceback" not in res.stderr
    run = latest(box)
    assert not list(run.glob("*.log")) and not list(run.glob("*.pid")), "nothing may have been started"
    assert json.loads((run / "state.json").read_text())["status"] == "failed"
    assert json.loads((run / "selfcheck.json").read_text())["decision"] == "refused"


def test_no_selfcheck_skips_it_and_says_so(box, stopper):
    res = up(box, "--detach", "--no-selfcheck", **{INJECT: "moe:wrong"})
    assert res.returncode == 0, res.stderr
    assert "skipped (--no-selfcheck)" in res.stdout and "unverified" in res.stdout
    assert not (latest(box) / "selfcheck.json").exists()
    # the switched-on patches run unverified; the auto one (the all-reduce) stays off without its check
    assert all(sw == {f"V4FLASH_{n.upper()}": "0" if n == "allreduce" or n not in SWITCHES else "1" for n in ALL}
               for sw in worker_switches(latest(box)).values())


def _running(pid: int) -> bool:
    """False once the process has exited: no such pid, or a zombie. `up` kills each check's process
    group and reaps its direct child; a process further down the group dies with it but waits for
    whichever process inherited it to reap it (on some hosts pid 1 does that late)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _standins_gone(run: Path) -> None:
    """Every stand-in check process the run started is gone (each record names its pid)."""
    pids = [json.loads(p.read_text())["pid"] for p in (run / "selfcheck").glob("*.json")]
    assert pids
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _running(pid)], "a stand-in check process outlived `up`"


def test_a_closed_stdout_during_the_check_stops_up_like_the_supervisor(box):
    """`up | head -n 1`: the reader quits after the check's first line; the check's processes are
    killed, nothing starts, the run dir says stopped and stderr says why (no traceback)."""
    argv = [sys.executable, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(box["cfg"]),
            "--topology", str(box["topology"])]
    cmd = " ".join(f"'{a}'" for a in argv) + ' | head -n 1; echo "rc=${PIPESTATUS[0]}" >&2'
    # GPU 3's check hangs, so it is still running when the other GPUs' lines meet the closed pipe
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=box["tmp"], timeout=60,
                         env=dict(box["env"], **{INJECT: "moe:hang@3"}))
    assert res.stdout.startswith("kernel self-check: ") and res.stdout.count("\n") == 1
    assert "stdout closed" in res.stderr and "nothing was started" in res.stderr and "Traceback" not in res.stderr
    assert res.stderr.rstrip().endswith("rc=1"), res.stderr
    run = latest(box)
    st = json.loads((run / "state.json").read_text())
    assert st["status"] == "stopped" and "stdout closed" in st["reason"] and not st.get("pids")
    assert not list(run.glob("*.log")), "nothing may have been started"
    _standins_gone(run)


def test_sigterm_during_the_check_stops_up_cleanly(box):
    p = subprocess.Popen([sys.executable, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(box["cfg"]),
                          "--topology", str(box["topology"])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(box["env"], **{INJECT: "moe:hang"}), cwd=box["tmp"])
    assert p.stdout is not None
    assert p.stdout.readline().startswith("kernel self-check: ")
    run_dir = box["tmp"] / "runs" / "latest"
    deadline = time.monotonic() + 30  # wait until a stand-in sits in the hanging patch
    while not any((json.loads(f.read_text()).get("running") or {}).get("patch") == "moe"
                  for f in run_dir.glob("selfcheck/*.json")):  # records are written atomically
        assert time.monotonic() < deadline and p.poll() is None, "the check did not reach the hanging patch"
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert "received SIGTERM during the kernel self-check" in out and "Traceback" not in err
    run = latest(box)
    st = json.loads((run / "state.json").read_text())
    assert st["status"] == "stopped" and st["reason"].startswith("SIGTERM")
    assert not list(run.glob("*.log")), "nothing may have been started"
    _standins_gone(run)


@pytest.mark.slow
def test_real_kernels_on_the_interpreter_a_broken_one_is_switched_off(box, stopper):
    """The real `python -m v4flash_kernels.selfcheck` (Triton interpreter, small shapes) in the worker's
    interpreter and env: the deliberately broken indexer is switched off, the correct kernels pass."""
    p = fakebox.free_ports(2)
    res = up(box, "--detach", "--profile", "rtx6000-tp4", "--set", "server.0.gpus=[0]", "--set", "server.0.tp=1",
             "--set", f"server.0.port={p[0]}", "--set", f"server.0.nccl_port={p[1]}",
             "--set", "server.0.host=127.0.0.1", config=False, V4FLASH_SELFCHECK_DEVICE="cpu",
             **{INJECT: "indexer:wrong"})
    assert res.returncode == 0, res.stdout + res.stderr
    run = latest(box)
    s = json.loads((run / "selfcheck.json").read_text())
    assert s["interpreter"] and not s["standin"]
    assert s["patches"]["sparse_decode"]["status"] == "pass" and s["patches"]["moe"]["status"] == "pass"
    assert s["patches"]["indexer"]["class"] == "wrong_result" and s["switched_off"] == ["indexer"]
    cases = s["gpus"][0]["patches"]["moe"]["cases"]
    assert cases and all(c["name"].startswith("small") and c["metrics"]["rel_err"] < 1e-2 for c in cases)
    assert worker_switches(run)["server-0"] == {f"V4FLASH_{n.upper()}": "0" if n == "indexer" or n not in SWITCHES
                                                else "1" for n in ALL}
    assert "CPU interpreter, small shapes only" in res.stdout


def test_status_of_a_run_without_a_selfcheck_says_it_was_skipped(box, stopper):
    res = up(box, "--detach", "--no-selfcheck")
    assert res.returncode == 0
    st = v4(box, "status", "--json", "--run-dir", str(latest(box)))
    assert json.loads(st.stdout)["selfcheck"]["skipped"] == "--no-selfcheck"


def test_a_second_up_on_the_run_dir_is_refused_before_its_selfcheck(box):
    """The run dir's lock is taken before the check: a second `up` on it is refused at once, runs no
    check of its own and leaves the first one's state alone."""
    run = box["tmp"] / "shared-run"
    first = subprocess.Popen([sys.executable, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(box["cfg"]),
                              "--topology", str(box["topology"]), "--run-dir", str(run)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(box["env"], **{INJECT: "moe:hang"}),
                             cwd=box["tmp"])
    try:
        assert first.stdout is not None
        assert first.stdout.readline().startswith("kernel self-check: ")
        before = json.loads((run / "state.json").read_text())
        assert before["status"] == "selfcheck" and before["launcher_pid"] == first.pid
        second = up(box, "--run-dir", str(run))
        assert second.returncode != 0
        assert f"error: run dir {run} is in use by another `v4flash-pd up` (pid {first.pid})" in second.stderr
        assert "fix: " in second.stderr and "Traceback" not in second.stderr
        assert "kernel self-check" not in second.stdout, "the loser ran a self-check"
        after = json.loads((run / "state.json").read_text())
        assert after["status"] == "selfcheck" and after["launcher_pid"] == first.pid
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert json.loads((run / "state.json").read_text())["reason"].startswith("SIGTERM")


def test_no_selfcheck_in_a_reused_run_dir_does_not_show_the_previous_verdict(box, stopper):
    run = box["tmp"] / "reused-run"
    res = up(box, "--detach", "--run-dir", str(run), **{INJECT: "moe:wrong@5"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((run / "selfcheck.json").read_text())["switched_off"] == ["moe"]
    assert v4(box, "down", "--run-dir", str(run)).returncode == 0
    res = up(box, "--detach", "--no-selfcheck", "--run-dir", str(run))
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        assert not (run / "selfcheck.json").exists(), "the previous run's verdict is still in the run dir"
        st = v4(box, "status", "--run-dir", str(run))
        assert "self-check skipped (--no-selfcheck)" in st.stdout and "moe FAILED" not in st.stdout, st.stdout
        js = json.loads(v4(box, "status", "--json", "--run-dir", str(run)).stdout)
        assert js["selfcheck"]["skipped"] == "--no-selfcheck" and "switched_off" not in js["selfcheck"]
        # and a check that runs again is this run's own, not a leftover "skipped"
    finally:
        v4(box, "down", "--run-dir", str(run))
    res = up(box, "--detach", "--run-dir", str(run))
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        js = json.loads(v4(box, "status", "--json", "--run-dir", str(run)).stdout)
        assert "skipped" not in js["selfcheck"] and js["selfcheck"]["decision"] == "ok"
    finally:
        v4(box, "down", "--run-dir", str(run))



# ----------------------------------------------------------------------------- on by default only where verified


def test_the_auto_allreduce_is_off_in_the_plan_and_on_once_its_check_passed(box, stopper):
    """Every switched-on patch gets a verdict (none unchecked), and the IPC all-reduce, off in `plan`,
    is switched on for the run only by its own passing check."""
    shown = v4(box, "plan", "--rehearse", "--config", str(box["cfg"]), "--topology", str(box["topology"]))
    assert shown.returncode == 0, shown.stderr
    assert "allreduce off until its self-check passes in `up` (auto)" in shown.stdout
    res = up(box, "--detach")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "kernel patch allreduce: self-check passed on every GPU of the plan; switched ON for this run" in res.stdout
    run = latest(box)
    s = json.loads((run / "selfcheck.json").read_text())
    assert sorted(s["patches"]) == sorted(SWITCHES)
    assert {n: p["status"] for n, p in s["patches"].items()} == dict.fromkeys(SWITCHES, "pass")
    assert s["switched_on"] == ["allreduce"] and s["kept_off"] == []
    plan = json.loads((run / "plan.json").read_text())
    assert dict(map(tuple, plan["patches"]))["allreduce"] is True
    for name, sw in worker_switches(run).items():
        assert sw["V4FLASH_ALLREDUCE"] == "1", name


def test_a_failing_auto_allreduce_stays_off_and_nothing_else_changes(box, stopper):
    res = up(box, "--detach", **{INJECT: "allreduce:wrong@6"})
    assert res.returncode == 0, res.stdout + res.stderr
    warning = next(line for line in res.stdout.splitlines() if line.startswith("WARNING kernel patch allreduce"))
    assert "GPU 6" in warning and "stays OFF" in warning
    run = latest(box)
    s = json.loads((run / "selfcheck.json").read_text())
    assert s["decision"] == "ok" and s["switched_off"] == [] and s["kept_off"] == ["allreduce"]
    plan = json.loads((run / "plan.json").read_text())
    assert dict(map(tuple, plan["patches"])) == {n: n != "allreduce" and n in SWITCHES for n in ALL}


def test_no_selfcheck_leaves_the_auto_allreduce_off(box, stopper):
    res = up(box, "--detach", "--no-selfcheck")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "allreduce stay(s) off" in res.stdout
    plan = json.loads((latest(box) / "plan.json").read_text())
    assert dict(map(tuple, plan["patches"]))["allreduce"] is False


def test_an_explicit_allreduce_on_is_on_without_waiting_and_still_checked(box, stopper):
    shown = v4(box, "plan", "--rehearse", "--config", str(box["cfg"]), "--topology", str(box["topology"]),
               "--allreduce", "on")
    assert "allreduce on" in shown.stdout and "(auto)" not in shown.stdout
    res = up(box, "--detach", "--allreduce", "on", **{INJECT: "allreduce:wrong@4"})
    assert res.returncode == 0, res.stdout + res.stderr
    s = json.loads((latest(box) / "selfcheck.json").read_text())
    assert s["switched_off"] == ["allreduce"], s


def _summary(**status: str) -> dict:
    return {"patches": {n: {"status": st} for n, st in status.items()}}


def test_decide_strict_refuses_a_switched_on_patch_without_a_check() -> None:
    from v4flash_pd.selfcheck.gate import Decision, decide

    v = decide(_summary(moe="pass", fp8_gemm="unchecked", allreduce="pass"), ("allreduce",), strict=True)
    assert v.refuse and v.unchecked == ("fp8_gemm",) and v.decision == Decision()
    v = decide(_summary(moe="pass", fp8_gemm="unchecked", allreduce="pass"), ("allreduce",), strict=False)
    assert not v.refuse and v.decision == Decision(off=(), on=("allreduce",))
    v = decide(_summary(moe="fail", allreduce="fail"), ("allreduce",), strict=False)
    assert v.decision == Decision(off=("moe",), on=()) and v.kept_off == ("allreduce",)
    v = decide(_summary(moe="pass", allreduce="fail"), ("allreduce",), strict=True)
    assert not v.refuse, "an auto switch that fails stays off; strict refuses only switched-on patches"
