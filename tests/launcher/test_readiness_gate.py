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

from v4flash_pd import topology as topo
from v4flash_pd.config.load import load_config
from v4flash_pd.host import Host
from v4flash_pd.plan import Plan, build_plan
from v4flash_pd.rundir import RunDir
from v4flash_pd.supervisor import Supervisor

pytestmark = pytest.mark.timeout(120)
T8 = Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json"


def _plan(prefills: list[int], decode: int, boot: int, port: int, metrics: int) -> Plan:
    """A rehearsal plan from the product's own builders (config -> build_plan), every port given."""
    sets = [f"python={sys.executable}", "numa=off", f"decode.0.port={decode}", f"router.port={port}",
            f"router.metrics_port={metrics}", 'router.host="127.0.0.1"']
    nccl = fakebox.free_ports(2 * len(prefills) + 1)
    boots = [boot] + nccl[len(prefills) + 1:]
    for i, pp in enumerate(prefills):
        sets += [f"prefill.{i}.port={pp}", f"prefill.{i}.bootstrap_port={boots[i]}", f"prefill.{i}.nccl_port={nccl[i]}"]
        if i:
            sets += [f"prefill.{i}.gpus=[{i * 2}, {i * 2 + 1}]", f"prefill.{i}.tp=2"]
    if len(prefills) > 1:
        sets += ["prefill.0.gpus=[0, 1]", "prefill.0.tp=2"]
    sets.append(f"decode.0.nccl_port={nccl[len(prefills)]}")
    return build_plan(load_config(env={}, sets=tuple(sets)), Host.remote(topo.load(T8)), rehearse=True)


def _spawn(plan: Plan, name: str) -> subprocess.Popen:
    """Start one process of the plan exactly as planned (argv + the plan's env over ours)."""
    p = plan.get(name)
    env = dict(os.environ, **dict(p.env), V4FLASH_REHEARSAL_LOAD_SECONDS="0")
    return subprocess.Popen(list(p.argv), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _sup(tmp: Path, plan: Plan) -> Supervisor:
    return Supervisor(plan, RunDir.create(tmp / "run"), echo=lambda m: None)


def test_router_gate_refuses_until_both_roles_are_healthy(tmp_path: Path) -> None:
    """Dead workers: the real router answers, but the gate must say not ready."""
    dead_p, dead_d, boot, port, metrics = fakebox.free_ports(5)
    plan = _plan([dead_p], dead_d, boot, port, metrics)
    r = _spawn(plan, "router")
    try:
        sup = _sup(tmp_path, plan)
        check = sup._router_check(plan.get("router"))
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
    plan = _plan([live_p, dead_p], live_d, boot, port, metrics)
    procs = [_spawn(plan, "prefill-0"), _spawn(plan, "decode-0"), _spawn(plan, "router")]  # prefill-1 stays down
    try:
        sup = _sup(tmp_path, plan)
        check = sup._router_check(plan.get("router"))
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
        from dataclasses import replace

        one = _sup(tmp_path, replace(plan, expected=(("prefill", 1), ("decode", 1))))  # a 1P1D expectation
        assert one._router_check(plan.get("router"))() == (True, "ready")
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
