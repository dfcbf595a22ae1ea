"""The router gate, against the real sglang-router 0.3.2: READY must wait for the router to report the
expected prefill/decode counts (sglang#33740: a router healthy before prefill is ready), and the smoke
request must really have gone through the router before READY."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fakebox
import pytest

from v4flash_pd.plan import Binding, Plan, ProcessSpec
from v4flash_pd.rundir import RunDir
from v4flash_pd.supervisor import Supervisor

pytestmark = pytest.mark.timeout(120)


def _router(prefill: str | list[str], decode: str, port: int, metrics: int) -> subprocess.Popen:
    pre = [a for url in ([prefill] if isinstance(prefill, str) else prefill) for a in ("--prefill", url, "8998")]
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", *pre,
         "--decode", decode, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(metrics), "--worker-startup-check-interval", "1",
         "--worker-startup-timeout-secs", "60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _engine(role: str, port: int, boot: int) -> subprocess.Popen:
    env = dict(os.environ, V4FLASH_REHEARSAL_LOAD_SECONDS="0")
    return subprocess.Popen([sys.executable, "-m", "v4flash_pd.rehearsal.engine", "--model-path", "m", "--host",
                             "127.0.0.1", "--port", str(port), "--disaggregation-mode", role,
                             "--disaggregation-bootstrap-port", str(boot)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _sup(tmp: Path, router_port: int, prefills: int = 1) -> Supervisor:
    spec = ProcessSpec(name="router", role="router", argv=("true",), env=(), gpus=(), binding=Binding(None, "none"),
                       ports=(), health_url=f"http://127.0.0.1:{router_port}/readiness")
    plan = Plan(profile="t", mode="pd", rehearse=True, model_path="", processes=(spec,),
                url=f"http://127.0.0.1:{router_port}", probe_url=f"http://127.0.0.1:{router_port}",
                expected=(("prefill", prefills), ("decode", 1)))
    return Supervisor(plan, RunDir.create(tmp / "run"), echo=lambda m: None)


def test_router_gate_refuses_until_both_roles_are_healthy(tmp_path: Path) -> None:
    """Dead workers: the real router answers, but the gate must say not ready."""
    dead_p, dead_d, port, metrics = fakebox.free_ports(4)
    r = _router(f"http://127.0.0.1:{dead_p}", f"http://127.0.0.1:{dead_d}", port, metrics)
    try:
        check = _sup(tmp_path, port)._router_check(_sup(tmp_path, port).plan.processes[0])
        seen = []
        end = time.monotonic() + 8
        while time.monotonic() < end:
            ok, detail = check()
            seen.append(detail)
            assert not ok, f"gate passed with dead workers: {detail}"
            time.sleep(0.5)
        assert any("router" in d for d in seen)
    finally:
        os.killpg(r.pid, signal.SIGKILL)
        r.wait(10)


def test_router_gate_waits_for_every_prefill_of_a_2p1d_plan(tmp_path: Path) -> None:
    """2P1D with one prefill still down: the router may call itself ready; the gate must not."""
    live_p, dead_p, live_d, boot, port, metrics = fakebox.free_ports(6)
    procs = [_engine("prefill", live_p, boot), _engine("decode", live_d, boot)]
    procs.append(_router([f"http://127.0.0.1:{live_p}", f"http://127.0.0.1:{dead_p}"],
                         f"http://127.0.0.1:{live_d}", port, metrics))
    try:
        sup = _sup(tmp_path, port, prefills=2)
        check = sup._router_check(sup.plan.processes[0])
        end = time.monotonic() + 10
        details = []
        while time.monotonic() < end:
            ok, detail = check()
            assert not ok, f"gate passed with one of two prefills down: {detail}"
            details.append(detail)
            if "prefill 1/2" in detail:
                break
            time.sleep(0.3)
        assert "prefill 1/2" in details[-1], details
        one = _sup(tmp_path, port, prefills=1)  # the same router satisfies a 1P1D expectation
        assert one._router_check(one.plan.processes[0])() == (True, "ready")
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_ready_comes_after_router_counts_and_a_real_smoke(tmp_path: Path) -> None:
    p = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, p)
    topo = fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)
    env = dict(os.environ, V4FLASH_RUNS_ROOT=str(tmp_path / "runs"), V4FLASH_REHEARSAL_LOAD_SECONDS="0.5")
    out = tmp_path / "up.out"
    with open(out, "w") as f:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "v4flash-pd"), "up", "--rehearse", "--config",
                                 str(cfg), "--topology", str(topo), "--grace", "5"],
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 60
        while "READY" not in out.read_text() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.1)
        assert "READY" in out.read_text(), out.read_text()
        run = (tmp_path / "runs" / "latest").resolve()
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        kinds = [(e["event"], e.get("name")) for e in events]
        order = [k for k in kinds if k in {("healthy", "prefill-0"), ("healthy", "decode-0"), ("start", "router"),
                                           ("smoke", None), ("ready", None)}]
        assert order[-3:] == [("start", "router"), ("smoke", None), ("ready", None)], kinds
        assert set(order[:2]) == {("healthy", "prefill-0"), ("healthy", "decode-0")}, kinds
        state = json.loads((run / "state.json").read_text())
        assert "[rehearsal]" in state["smoke_text"]
        # the smoke generate really reached decode through the router (a PD request with a room)
        decode_gen = [r for r in fakebox.json_records((run / "decode-0.log").read_text())
                      if r.get("path") == "/generate"]
        assert decode_gen and decode_gen[0].get("bootstrap_room") is not None
        router_log = (run / "router.log").read_text()
        assert router_log.strip(), "router wrote nothing"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
