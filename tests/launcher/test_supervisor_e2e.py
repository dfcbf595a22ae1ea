"""What operators do to a running launcher, end to end on 127.0.0.1: the real CLI as a subprocess, the
real sglang-router, stand-in engines. Closed stdout, SIGHUP, SIGSTOP (hangs), `down` on a run whose
pids were reused or whose state.json is corrupt, two `up` on one run dir. Every test checks that no
process group is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import fakebox
import pytest
from fakebox import group_alive

pytestmark = pytest.mark.timeout(180)

PY = sys.executable



class Box:
    """A 1P1D rehearsal config on fresh ports, and the environment `up` runs in."""

    def __init__(self, tmp: Path, **env: str) -> None:
        self.tmp = tmp
        self.ports = fakebox.free_ports(7)
        self.cfg = fakebox.write_pd_config(tmp, self.ports)
        self.topology = fakebox.write_topology(tmp, fakebox.BOX_8GPU_2NODE)
        self.env = fakebox.clean_env()
        self.env.update({"V4FLASH_RUNS_ROOT": str(tmp / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.5",
                         "V4FLASH_PROGRESS_INTERVAL": "0.5", "V4FLASH_GRACE": "5"})
        self.env.update(env)
        self.started: list[subprocess.Popen] = []

    def up_argv(self, *extra: str) -> list[str]:
        return [PY, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(self.cfg),
                "--topology", str(self.topology), *extra]

    def up(self, *extra: str, out: str = "up.out") -> subprocess.Popen:
        self.out = self.tmp / out
        with open(self.out, "w") as f:
            p = subprocess.Popen(self.up_argv(*extra), env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.started.append(p)
        return p

    def text(self) -> str:
        return self.out.read_text()

    def wait_text(self, needle: str, p: subprocess.Popen, timeout: float = 60) -> None:
        fakebox.wait_for(lambda: needle in self.text() or p.poll() is not None, timeout, needle)
        assert needle in self.text(), f"{needle!r} not seen (rc={p.poll()}):\n{self.text()}"

    def cli(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "v4flash_pd", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def run_dir(self) -> Path:
        return (self.tmp / "runs" / "latest").resolve()

    def state(self, run: Path | None = None) -> dict:
        return json.loads(((run or self.run_dir()) / "state.json").read_text())

    def pids(self, run: Path | None = None) -> dict[str, int]:
        return {k: int(v) for k, v in self.state(run)["pids"].items()}

    def cleanup(self) -> None:
        for p in self.started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        # whatever a broken launcher left behind: every process started with this test's environment,
        # or writing its output into this test's directory (a retitled router's environ is overwritten)
        mark = f"V4FLASH_RUNS_ROOT={self.tmp / 'runs'}".encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if (mark in (d / "environ").read_bytes().split(b"\0")
                        or os.readlink(d / "fd" / "1").startswith(str(self.tmp) + "/")):
                    os.kill(int(d.name), signal.SIGCONT)
                    os.kill(int(d.name), signal.SIGKILL)
            except (OSError, ValueError):
                pass


@pytest.fixture
def box(tmp_path: Path):
    b = Box(tmp_path)
    yield b
    b.cleanup()


def _assert_all_gone(pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        fakebox.wait_for(lambda pid=pid: not group_alive(pid), 10, f"{name} (pgid {pid}) to go")


# ------------------------------------------------------------------ closed stdout, SIGHUP


@pytest.mark.parametrize("reader", ["head -n 15", "sed '/] started /q'"])
def test_up_piped_into_a_reader_that_quits_stops_everything(box: Box, reader: str) -> None:
    """`up --rehearse | head -n 15`: the reader exits, the next line fails with EPIPE, and that must stop
    whatever already started. `sed '/] started /q'` quits right after the workers were spawned, so the
    trio is certainly running when the pipe breaks (with `head` it depends on how long the plan is).
    `head` gets no self-check, whose 15 lines would break the pipe before the supervisor runs (that
    case is test_selfcheck_up.py's)."""
    extra = ("--no-selfcheck",) if reader.startswith("head") else ()
    cmd = " ".join(f"'{a}'" for a in box.up_argv(*extra)) + f" | {reader}"
    box.out = box.tmp / "pipe.out"
    with open(box.out, "w") as f:
        sh = subprocess.Popen(["sh", "-c", cmd], env=box.env, stdout=f, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    box.started.append(sh)
    _, err = sh.communicate(timeout=90)
    run = box.run_dir()
    st = box.state(run)
    pids = {k: int(v) for k, v in st.get("pids", {}).items()}
    if reader.startswith("sed"):
        assert set(pids) == {"prefill-0", "decode-0"}, st
        assert re.match(r"\[[-0-9]+ [:0-9]+\] started prefill-0, decode-0", box.text().splitlines()[-1])
    else:
        assert len(box.text().splitlines()) == 15
    _assert_all_gone(pids)
    assert "Traceback" not in err, err
    assert "stdout closed" in err, err
    assert st["status"] == "stopped"


def test_sighup_stops_the_trio_like_sigterm(box: Box) -> None:
    p = box.up()
    box.wait_text("READY", p)
    pids = box.pids()
    os.kill(p.pid, signal.SIGHUP)
    assert p.wait(30) == 0, box.text()
    assert "received SIGHUP; stopped cleanly" in box.text()
    _assert_all_gone(pids)
    st = box.state()
    assert st["status"] == "stopped" and st["reason"] == "SIGHUP"


# ------------------------------------------------------------------ hangs


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("victim", ["decode-0", "router"])
def test_a_process_that_stops_answering_after_ready_is_noticed_within_its_window(box: Box, victim: str) -> None:
    window = 2.0
    p = box.up("--set", f"hang_timeout={window}")
    box.wait_text("READY", p)
    run = box.run_dir()
    pids = box.pids()
    t_stop = time.time()
    os.killpg(pids[victim], signal.SIGSTOP)
    rc = p.wait(60)
    out = box.text()
    assert rc == 1, out
    assert f"{victim} is not answering after READY" in out, out
    assert "stopped by a signal" in out, out
    hung = [e for e in _events(run) if e["event"] == "hung"]
    assert hung and hung[0]["name"] == victim, _events(run)
    took = hung[0]["t"] - t_stop
    assert took <= window + 1.0, f"hang noticed {took:.2f}s after SIGSTOP (window {window}s)"
    _assert_all_gone(pids)
    assert box.state(run)["status"] == "failed"


def test_a_worker_that_hangs_while_loading_is_reported_hung_not_not_listening(box: Box) -> None:
    box.env["V4FLASH_REHEARSAL_LOAD_SECONDS"] = "60"
    p = box.up("--set", "hang_timeout=3")
    box.wait_text("waiting for workers to load", p)
    run = box.run_dir()
    pids = box.pids()
    plan = json.loads((run / "plan.json").read_text())
    decode_port = next(x for x in plan["processes"] if x["name"] == "decode-0")["health_url"]
    import urllib.error
    import urllib.request

    def answers_503() -> bool:
        try:
            urllib.request.urlopen(decode_port, timeout=1)
        except urllib.error.HTTPError as exc:
            return exc.code == 503
        except OSError:
            return False
        return False

    fakebox.wait_for(answers_503, 30, "decode to listen (503 while loading)")
    before = len(box.text())
    os.killpg(pids["decode-0"], signal.SIGSTOP)
    rc = p.wait(60)
    out = box.text()
    assert rc == 1, out
    progress = [line for line in out[before:].splitlines() if "waiting for workers to load" in line]
    assert any("decode-0 not answering" in line for line in progress), progress
    assert not any("decode-0 not listening" in line for line in progress), progress
    assert "decode-0 is not answering while loading" in out, out
    _assert_all_gone(pids)


def test_status_says_not_answering_for_a_stopped_worker(box: Box) -> None:
    res = box.cli("up", "--rehearse", "--detach", "--config", str(box.cfg), "--topology", str(box.topology),
                  "--set", "hang_timeout=120")
    assert res.returncode == 0, res.stdout + res.stderr
    pids = box.pids()
    os.killpg(pids["decode-0"], signal.SIGSTOP)
    try:
        st = box.cli("status")
        assert st.returncode == 0, st.stderr
        line = next(x for x in st.stdout.splitlines() if x.strip().startswith("decode-0"))
        assert "up" in line and "not answering" in line, st.stdout
        info = json.loads(box.cli("status", "--json").stdout)
        by = {p["name"]: p for p in info["processes"]}
        assert by["decode-0"]["answer"].startswith("not answering")
        assert by["prefill-0"]["answer"] == "healthy"
    finally:
        os.killpg(pids["decode-0"], signal.SIGCONT)
    down = box.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    _assert_all_gone(pids)


# ------------------------------------------------------------------ down never signals what is not ours


def _foreign() -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_down_never_signals_reused_pids_init_or_its_own_group(box: Box) -> None:
    res = box.cli("up", "--rehearse", "--detach", "--config", str(box.cfg), "--topology", str(box.topology))
    assert res.returncode == 0, res.stdout + res.stderr
    run = box.run_dir()
    st = box.state()
    pids = box.pids()
    # the launcher and its processes die without cleaning up (OOM killer, kill -9)
    os.kill(int(st["launcher_pid"]), signal.SIGKILL)
    for pid in pids.values():
        os.killpg(pid, signal.SIGKILL)
    _assert_all_gone(pids)
    reused, retitled = _foreign(), _foreign()
    try:
        fakebox.wait_for(lambda: Path(f"/proc/{retitled.pid}/cmdline").read_bytes().count(b"\0") >= 3, 10, "foreign exec")
        stat = Path(f"/proc/{retitled.pid}/stat").read_text()
        retitled_start = int(stat[stat.rfind(")") + 2:].split()[19])
        procs = st["procs"]
        # decode's pid now belongs to someone else (a different start time)
        procs["decode-0"] = dict(procs["decode-0"], pid=reused.pid)
        # prefill's record matches a live process's start time but not its command line
        procs["prefill-0"] = dict(procs["prefill-0"], pid=retitled.pid, start_time=retitled_start)
        procs["router"] = dict(procs["router"], pid=1)
        st["launcher"] = dict(st["launcher"], pid=os.getpgrp())
        st.update(procs=procs, pids={"decode-0": reused.pid, "prefill-0": retitled.pid, "router": 1},
                  launcher_pid=os.getpgrp())
        (run / "state.json").write_text(json.dumps(st))
        down = box.cli("down")
        time.sleep(0.5)
        assert reused.poll() is None and retitled.poll() is None, "down signalled a process that is not ours"
        assert "not what we started" in down.stdout, down.stdout
        assert "refusing to signal process group 1" in down.stdout, down.stdout
    finally:
        for p in (reused, retitled):
            p.kill()
            p.wait(10)


def test_down_with_a_corrupt_state_json_uses_the_pid_files(box: Box) -> None:
    res = box.cli("up", "--rehearse", "--detach", "--config", str(box.cfg), "--topology", str(box.topology))
    assert res.returncode == 0, res.stdout + res.stderr
    run = box.run_dir()
    pids = box.pids()
    launcher = int(box.state()["launcher_pid"])
    (run / "state.json").write_text('{"status": "ready", "pids": {"decode-0": ')
    down = box.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "state.json is corrupt" in down.stdout and ".pid files" in down.stdout, down.stdout
    _assert_all_gone(pids)
    fakebox.wait_for(lambda: not Path(f"/proc/{launcher}").exists()
                     or "Z" in Path(f"/proc/{launcher}/stat").read_text().split()[2], 10, "launcher to exit")


# ------------------------------------------------------------------ one run dir, one `up`


def test_a_second_up_on_the_same_run_dir_is_refused(box: Box, tmp_path: Path) -> None:
    run = tmp_path / "shared-run"
    res = box.cli("up", "--rehearse", "--detach", "--config", str(box.cfg), "--topology", str(box.topology),
                  "--run-dir", str(run))
    assert res.returncode == 0, res.stdout + res.stderr
    first = box.pids(run)
    other = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7), name="other.toml")
    second = box.cli("up", "--rehearse", "--config", str(other), "--topology", str(box.topology),
                     "--run-dir", str(run), timeout=60)
    assert second.returncode == 2, second.stdout + second.stderr
    assert "in use by another `v4flash-pd up`" in second.stderr and "fix:" in second.stderr
    assert "Traceback" not in second.stderr
    assert box.pids(run) == first and box.state(run)["status"] == "ready"
    down = box.cli("down", "--run-dir", str(run))
    assert down.returncode == 0
    _assert_all_gone(first)


def test_down_stops_what_a_killed_launcher_left_including_the_retitled_router(box: Box) -> None:
    """The launcher dies (kill -9) and leaves the trio running; `down` stops each group itself after
    checking it is ours (the router renames itself `sglang::router`, recorded after READY)."""
    res = box.cli("up", "--rehearse", "--detach", "--config", str(box.cfg), "--topology", str(box.topology))
    assert res.returncode == 0, res.stdout + res.stderr
    st = box.state()
    pids = box.pids()
    router_cmd = Path(f"/proc/{pids['router']}/cmdline").read_bytes().split(b"\0")[0]
    assert router_cmd.startswith(b"sglang::router"), router_cmd
    os.kill(int(st["launcher_pid"]), signal.SIGKILL)
    time.sleep(0.3)
    assert not any(not group_alive(p) for p in pids.values())
    down = box.cli("down", "--grace", "5")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped leftover process groups" in down.stdout and "router" in down.stdout, down.stdout
    _assert_all_gone(pids)
    assert box.state()["status"] == "stopped"


def test_status_reports_each_kernel_patch_per_worker_in_both_file_formats(box: Box) -> None:
    res = box.cli("up", "--rehearse", "--detach", "--config", str(box.cfg), "--topology", str(box.topology))
    assert res.returncode == 0, res.stdout + res.stderr
    run = box.run_dir()
    pids = box.pids()
    (run / "patch" / f"patch-{pids['decode-0']}.json").write_text(json.dumps({
        "pid": pids["decode-0"], "patches": {
            "sparse_decode": {"active": True, "reason": "replaced flash_mla_sparse_decode_triton"},
            "moe": {"active": False, "reason": "V4FLASH_MOE=0"},
            "indexer": {"active": True, "reason": "replaced fp8_paged_mqa_logits_torch_sm120"}}}))
    (run / "patch" / f"patch-{pids['prefill-0']}.json").write_text(json.dumps({
        "pid": pids["prefill-0"], "active": False, "reason": "sglang is not the pinned version"}))
    (run / "patch" / "patch-999999.json").write_text("{broken")
    try:
        info = json.loads(box.cli("status", "--json").stdout)
        by = {r["worker"]: r for r in info["kernel_patch"] if r.get("worker")}
        assert set(by["decode-0"]["patches"]) == {"sparse_decode", "moe", "indexer"}
        assert by["decode-0"]["patches"]["moe"] == {"active": False, "reason": "V4FLASH_MOE=0"}
        assert by["prefill-0"]["patches"] == {"sparse_decode": {"active": False,
                                                               "reason": "sglang is not the pinned version"}}
        assert any(r.get("error") == "unreadable" and r["pid"] == 999999 for r in info["kernel_patch"])
        text = box.cli("status").stdout
        assert "kernel patch moe            decode-0 pid" in text and "inactive (V4FLASH_MOE=0)" in text, text
        assert "kernel patch indexer        decode-0" in text and "kernel patch sparse_decode  prefill-0" in text, text
    finally:
        assert box.cli("down").returncode == 0
    _assert_all_gone(pids)


def test_the_watchdog_probes_a_router_with_an_api_key_without_false_alarms(box: Box) -> None:
    """With client authentication on the router, its health probes still count as answers: no hang is
    declared over several windows; SIGSTOP on the router still is one."""
    key = box.tmp / "router.key"
    key.write_text("s3cret-for-tests\n")
    key.chmod(0o600)
    p = box.up("--set", "hang_timeout=1.5", "--set", f"router.api_key_file={key}")
    box.wait_text("READY", p)
    pids = box.pids()
    time.sleep(5)  # over three windows of probing
    assert p.poll() is None, box.text()
    os.killpg(pids["router"], signal.SIGSTOP)
    assert p.wait(30) == 1, box.text()
    assert "router is not answering after READY" in box.text()
    assert "s3cret-for-tests" not in box.text()
    _assert_all_gone(pids)


def test_a_worker_that_freezes_while_the_router_starts_fails_the_start_fast(box: Box) -> None:
    """Healthy workers, then decode freezes before READY (router start, smoke): without a watch the
    gate would wait for ready_timeout; it must stop everything within the hang window instead."""
    p = box.up("--set", "hang_timeout=2", "--ready-timeout", "120")
    box.wait_text("decode-0 is healthy", p)
    pids = box.pids()
    os.killpg(pids["decode-0"], signal.SIGSTOP)
    t0 = time.monotonic()
    assert p.wait(60) == 1, box.text()
    took = time.monotonic() - t0
    assert "decode-0 is not answering while waiting for the router to see all workers" in box.text() \
        or "decode-0 is not answering during the smoke request" in box.text(), box.text()
    assert took < 2 + 5 + 5, f"took {took:.1f}s"  # window + grace (a stopped group gets SIGCONT) + slack
    assert "READY" not in box.text() and "not signalled" not in box.text(), box.text()
    _assert_all_gone(box.pids())  # the router too, although it renamed itself (sglang::router) before READY


def test_workers_slow_to_stop_get_sigkill_after_the_grace_period(box: Box) -> None:
    box.env.update(V4FLASH_REHEARSAL_STOP_DELAY_S="60", V4FLASH_GRACE="1.5")
    p = box.up()
    box.wait_text("READY", p)
    pids = box.pids()
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(30) == 0, box.text()
    took = time.monotonic() - t0
    assert "SIGKILL: decode-0, prefill-0" in box.text(), box.text()
    assert 1.5 <= took < 1.5 + 5, took
    _assert_all_gone(pids)


def test_a_second_stop_signal_skips_the_rest_of_the_grace_period(box: Box) -> None:
    box.env.update(V4FLASH_REHEARSAL_STOP_DELAY_S="60", V4FLASH_GRACE="60")
    p = box.up()
    box.wait_text("READY", p)
    pids = box.pids()
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGINT)
    time.sleep(1.0)
    assert p.poll() is None, "stopped before the grace period although the workers were still stopping"
    os.kill(p.pid, signal.SIGINT)  # the impatient second Ctrl-C
    p.wait(30)
    took = time.monotonic() - t0
    assert took < 10, f"the second signal did not cut the 60 s grace short ({took:.1f}s)"
    assert "SIGKILL: decode-0, prefill-0" in box.text(), box.text()
    _assert_all_gone(pids)


def test_a_repeated_sigterm_keeps_the_grace_period(box: Box) -> None:
    """Schedulers repeat SIGTERM (Slurm's scancel signals every step, the kubelet, docker): that is
    not a person's second Ctrl-C, and must neither SIGKILL workers that are still stopping nor make the
    launcher die of the signal instead of exiting 0."""
    box.env.update(V4FLASH_REHEARSAL_STOP_DELAY_S="2", V4FLASH_GRACE="30")
    p = box.up()
    box.wait_text("READY", p)
    pids = box.pids()
    os.kill(p.pid, signal.SIGTERM)
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while p.poll() is None and time.monotonic() < deadline:  # more TERMs while it stops and exits
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    assert p.wait(30) == 0, box.text()
    assert "SIGKILL" not in box.text(), box.text()
    assert "stopped cleanly" in box.text(), box.text()
    _assert_all_gone(pids)


def test_detach_into_a_reused_run_dir_waits_for_its_own_launcher(box: Box, tmp_path: Path) -> None:
    """The run dir still says `stopped` from the previous run: `up --detach` must not take that for its
    own launcher's answer (it used to report a failure and leave the new launcher and trio running)."""
    run = tmp_path / "reused"
    common = ["up", "--rehearse", "--detach", "--config", str(box.cfg), "--topology", str(box.topology),
              "--run-dir", str(run)]
    first = box.cli(*common)
    assert first.returncode == 0, first.stdout + first.stderr
    assert box.cli("down", "--run-dir", str(run)).returncode == 0
    assert box.state(run)["status"] == "stopped"
    second = box.cli(*common)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "READY" in second.stdout
    st = box.state(run)
    assert st["status"] == "ready" and all(group_alive(p) for p in box.pids(run).values())
    assert box.cli("down", "--run-dir", str(run)).returncode == 0
    _assert_all_gone(box.pids(run))
