"""End to end on 127.0.0.1: the real CLI, real numactl, the real sglang-router binary, stand-in engines.

Each test runs `v4flash-pd up --rehearse` as a subprocess with every port taken fresh, and checks
what an operator sees: READY, a generate through the router, the PD handshake, fail-fast with the
dead role's log tail, clean SIGTERM with nothing left behind, busy ports refused up front.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import fakebox
import pytest
from fakebox import group_alive

pytestmark = pytest.mark.timeout(120)

BIN = Path(sys.executable).parent / "v4flash-pd"


@pytest.fixture()
def box(tmp_path: Path) -> dict:
    p = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, p)
    env = dict(os.environ)
    env.update({
        "V4FLASH_RUNS_ROOT": str(tmp_path / "runs"),
        "V4FLASH_REHEARSAL_LOAD_SECONDS": "1.5",
        "V4FLASH_PROGRESS_INTERVAL": "1",
        "V4FLASH_GRACE": "5",
    })
    env.pop("V4FLASH_SET", None)
    return {"cfg": cfg, "topology": fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE), "env": env, "ports": p,
            "tmp": tmp_path,
            "router": f"http://127.0.0.1:{p[5]}"}


class Up:
    """A running `v4flash-pd up --rehearse`, its output collected line by line."""

    def __init__(self, box: dict, *extra: str) -> None:
        self.box = box
        self.out_path = box["tmp"] / "up.out"
        self.out = open(self.out_path, "w")
        self.proc = subprocess.Popen([str(BIN), "up", "--rehearse", "--config", str(box["cfg"]),
                                      "--topology", str(box["topology"]), *extra],
                                     env=box["env"], stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.out_path.read_text()

    def wait_for(self, needle: str, timeout: float = 40) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if needle in self.text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} not seen (rc={self.proc.poll()}):\n{self.text()}")

    def run_dir(self) -> Path:
        runs = self.box["tmp"] / "runs"
        return (runs / "latest").resolve()

    def state(self) -> dict:
        return json.loads((self.run_dir() / "state.json").read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        st_pids = []
        try:
            st_pids = list(self.state().get("pids", {}).values())
        except (OSError, ValueError):
            pass
        for pid in st_pids:
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.out.close()


@pytest.fixture()
def up(box: dict):
    started: list[Up] = []

    def start(*extra: str) -> Up:
        u = Up(box, *extra)
        started.append(u)
        return u

    yield start
    for u in started:
        u.close()


def _post(url: str, body: dict, timeout: float = 20) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


@pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl not installed (CI installs it)")
def test_ready_generate_handshake_then_sigterm_leaves_nothing(box: dict, up) -> None:
    u = up()
    u.wait_for("READY")
    status, body = _post(box["router"] + "/generate",
                         {"text": "Hello there", "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert status == 200
    assert body["text"].strip(), body
    assert "rehearsal" in json.dumps(body).lower()

    run = u.run_dir()
    # the PD handshake: decode fetched exactly the room prefill registered, over prefill's bootstrap port
    registered = {r["bootstrap_room"] for r in fakebox.json_records((run / "prefill-0.log").read_text())
                  if r.get("rehearsal") == "room_registered"}
    fetched = [r for r in fakebox.json_records((run / "decode-0.log").read_text()) if r.get("bootstrap_room") is not None
               and r.get("path") == "/generate"]
    assert registered, "prefill never registered a bootstrap room"
    assert {r["bootstrap_room"] for r in fetched} & registered
    assert all(r.get("bootstrap_port") == box["ports"][1] for r in fetched)

    # real numactl wrapped prefill (node 0 exists everywhere); decode's node 1 was skipped loudly
    prefill_cmd = (run / "prefill-0.command").read_text()
    assert "--cpunodebind=0" in prefill_cmd and "--membind=0" in prefill_cmd
    text = u.text()
    if not Path("/sys/devices/system/node/node1").exists():
        assert "decode-0: NUMA binding to node 1 skipped in rehearsal" in text
    for name in ("prefill-0", "decode-0", "router"):
        assert (run / f"{name}.log").exists() and (run / f"{name}.pid").exists() and (run / f"{name}.command").exists()
    assert json.loads((run / "plan.json").read_text())["rehearse"] is True
    pids = u.state()["pids"]

    t0 = time.monotonic()
    os.kill(u.proc.pid, signal.SIGTERM)
    assert u.proc.wait(20) == 0, u.text()
    took = time.monotonic() - t0
    assert took < 5 + 2, f"shutdown took {took:.1f}s"
    assert "stopped cleanly" in u.text()
    for name, pid in pids.items():
        assert not group_alive(int(pid)), f"{name} (pgid {pid}) still has processes"
    assert u.state()["status"] == "stopped"


def test_killing_decode_stops_everything_with_its_log_tail(box: dict, up) -> None:
    u = up()
    u.wait_for("READY")
    pids = u.state()["pids"]
    os.killpg(int(pids["decode-0"]), signal.SIGKILL)
    rc = u.proc.wait(30)
    out = u.text()
    assert rc == 1, out
    assert "decode-0 was killed by SIGKILL unexpectedly" in out
    assert "rehearsal stand-in for sglang.launch_server" in out  # a line from decode's own log, echoed as the tail
    assert "v4flash-pd logs decode-0" in out
    for name, pid in pids.items():
        assert not group_alive(int(pid)), f"{name} survived the fail-fast stop"
    assert u.state()["status"] == "failed"


def test_busy_port_refused_before_anything_starts(box: dict, up) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", box["ports"][5]))  # the router's port
    s.listen(1)
    try:
        u = up()
        rc = u.proc.wait(30)
        out = u.text()
    finally:
        s.close()
    assert rc == 2, out
    assert f"{box['ports'][5]} (router http" in out and "fix:" in out
    assert "Traceback" not in out
    assert not (box["tmp"] / "runs").exists() or not list((box["tmp"] / "runs").glob("*/prefill-0.log"))


def test_real_up_refuses_missing_model(box: dict) -> None:
    res = subprocess.run([str(BIN), "up", "--config", str(box["cfg"]), "--topology", str(box["topology"]),
                          "--model", str(box["tmp"] / "no-such-model"), "--numa", "off"],
                         env=box["env"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res.stderr
    assert "does not exist; refusing to start" in res.stderr and "--rehearse" in res.stderr


def test_detach_status_logs_down(box: dict) -> None:
    env = box["env"]
    common = ["--config", str(box["cfg"]), "--topology", str(box["topology"])]
    res = subprocess.run([str(BIN), "up", "--rehearse", "--detach", *common], env=env,
                         capture_output=True, text=True, timeout=60)
    run = (box["tmp"] / "runs" / "latest").resolve()
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        assert "READY" in res.stdout
        st = subprocess.run([str(BIN), "status", "--json"], env=env, capture_output=True, text=True, timeout=30)
        info = json.loads(st.stdout)
        assert info["status"] == "ready" and info["launcher_alive"]
        assert {p["name"]: p["health"] for p in info["processes"]} == {"prefill-0": 200, "decode-0": 200, "router": 200}
        logs = subprocess.run([str(BIN), "logs", "decode", "-n", "5"], env=env, capture_output=True, text=True, timeout=30)
        assert logs.returncode == 0 and len(logs.stdout.splitlines()) == 5
        bad = subprocess.run([str(BIN), "logs", "nosuchrole"], env=env, capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "decode-0" in bad.stderr
        down = subprocess.run([str(BIN), "down"], env=env, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        assert "launcher stopped the run" in down.stdout
        st2 = json.loads(subprocess.run([str(BIN), "status", "--json"], env=env, capture_output=True, text=True,
                                        timeout=30).stdout)
        assert st2["status"] == "stopped"
        assert not any(p["alive"] for p in st2["processes"])
    finally:
        state = json.loads((run / "state.json").read_text()) if (run / "state.json").exists() else {}
        for pid in list(state.get("pids", {}).values()) + [state.get("launcher_pid")]:
            if pid:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_doctor_beside_a_live_rehearsal_knows_its_ports(box: dict) -> None:
    """`doctor --rehearse` with the options of a rehearsal that is up: the trio's own ports are that run's
    (said as information), not errors; a port held by anything else still is one."""
    env = box["env"]
    common = ["--config", str(box["cfg"]), "--topology", str(box["topology"])]
    res = subprocess.run([str(BIN), "up", "--rehearse", "--detach", *common], env=env,
                         capture_output=True, text=True, timeout=60)
    run = (box["tmp"] / "runs" / "latest").resolve()
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        doc = subprocess.run([str(BIN), "doctor", "--rehearse", "--json", *common], env=env, capture_output=True,
                             text=True, timeout=120)
        checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
        errors = {n: c["detail"] for n, c in checks.items() if c["status"] == "error"}
        assert errors == {} and doc.returncode in (0, 3), (doc.returncode, errors)
        ports = checks["ports"]
        assert ports["status"] == "ok" and f"in use by the running rehearsal {run}" in ports["detail"], ports
        assert str(box["ports"][5]) in ports["detail"]  # the router's, named
        # a stranger on a port of the plan is still an error
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            other = s.getsockname()[1]
            doc = subprocess.run([str(BIN), "doctor", "--rehearse", "--json", *common, "--set",
                                  f"router.metrics_port={other}"], env=env, capture_output=True, text=True, timeout=120)
        ports = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}["ports"]
        assert ports["status"] == "error" and str(other) in ports["detail"], ports
        assert f"in use by the running rehearsal {run}" in ports["detail"] and doc.returncode == 4
    finally:
        subprocess.run([str(BIN), "down", "--run-dir", str(run)], env=env, capture_output=True, timeout=60)
