"""End to end on 127.0.0.1 with the real CLI, the real sglang-router and stand-in engines:
`up --rehearse --mtp 3` is READY with the speculative flags on both workers and `bench` reports the
served accept length through the router; the 2xTP2 decode layout is READY with the router listing 1
prefill + 2 decode workers and requests spread over both."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import fakebox
import pytest

pytestmark = pytest.mark.timeout(180)
pytest.importorskip("sglang_router", reason="the real sglang-router is part of the test env")

BIN = Path(sys.executable).parent / "v4flash-pd"
SPEC_FIELDS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
               "speculative_num_draft_tokens")


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = fakebox.clean_env()
    env.update({"V4FLASH_RUNS_ROOT": str(tmp / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "1",
                "V4FLASH_GRACE": "5", **extra})
    return env


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.loads(r.read())


class Run:
    """`up --rehearse --detach`, stopped with `down` (and every pid killed if that fails)."""

    def __init__(self, tmp: Path, env: dict[str, str], args: list[str]) -> None:
        self.tmp, self.env = tmp, env
        self.up = subprocess.run([str(BIN), "up", "--rehearse", "--detach", *args], env=env, capture_output=True,
                                 text=True, timeout=120)
        self.dir = (tmp / "runs" / "latest").resolve()

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN), *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text()

    def close(self) -> None:
        self.cli("down", timeout=60)
        state = json.loads((self.dir / "state.json").read_text()) if (self.dir / "state.json").exists() else {}
        for pid in list(state.get("pids", {}).values()) + [state.get("launcher_pid")]:
            if pid:
                try:
                    os.killpg(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Run]]:
    runs: list[Run] = []
    yield runs
    for r in runs:
        r.close()


def test_up_rehearse_mtp3_ready_with_the_flags_on_both_workers(tmp_path: Path, started: list[Run]) -> None:
    ports = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, ports)
    topo = fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)
    run = Run(tmp_path, _env(tmp_path, V4FLASH_REHEARSAL_ACCEPT_LENGTH="2.5"),
              ["--config", str(cfg), "--topology", str(topo), "--mtp", "3"])
    started.append(run)
    assert run.up.returncode == 0, run.up.stdout + run.up.stderr
    assert "READY" in run.up.stdout
    launcher = run.log("launcher")
    assert "spec     EAGLE with the MTP layer: 3 draft step(s), top-k 1, 4 tokens verified per step" in launcher
    for name, port in (("prefill-0", ports[0]), ("decode-0", ports[3])):
        info = _get(f"http://127.0.0.1:{port}/server_info")
        assert tuple(info[k] for k in SPEC_FIELDS) == ("EAGLE", 3, 1, 4), name
        assert info["ignored_args"] == [] or not any(a.startswith("--speculative") for a in info["ignored_args"])
        command = (run.dir / f"{name}.command").read_text()
        assert ("--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
                "--speculative-num-draft-tokens 4") in command, name
    router = f"http://127.0.0.1:{ports[5]}"
    # the served accept length through the router: 21 tokens, the first from prefill, 20 from verifies at
    # 2.5 tokens each -> 8 verifies -> completion_tokens / verifies = 21 / 8 (SGLang's definition)
    bench = run.cli("bench", "--url", router, "--concurrency", "1,2", "--requests", "4", "--output-len", "21",
                    "--input-len", "4", "--json")
    assert bench.returncode == 0, bench.stderr
    levels = json.loads(bench.stdout)["levels"]
    assert [lv["accept_length"] for lv in levels] == [21 / math.ceil(20 / 2.5)] * 2
    table = run.cli("bench", "--url", router, "--concurrency", "1", "--requests", "2", "--output-len", "21")
    assert "accept len" in table.stdout and "2.62" in table.stdout
    # decode did the verifies: its server info counts them over every request so far (the smoke test's and
    # the warm-ups' too), tokens from verifies / verifies, each request at most 2.5
    dec = _get(f"http://127.0.0.1:{ports[3]}/server_info")["internal_states"][0]
    assert 2.0 < dec["avg_spec_accept_length"] <= 2.5
    assert "avg_spec_accept_length" not in _get(f"http://127.0.0.1:{ports[0]}/server_info")["internal_states"][0]
    ev = run.cli("eval", "--url", router, "--questions", "4", "--json")
    assert ev.returncode == 0 and json.loads(ev.stdout)["speculative"] is True, ev.stdout + ev.stderr


def test_bench_without_speculation_reports_no_accept_length(tmp_path: Path, started: list[Run]) -> None:
    ports = fakebox.free_ports(7)
    # speculative decoding is on by default (2 draft steps): off here on purpose
    run = Run(tmp_path, _env(tmp_path), ["--config", str(fakebox.write_pd_config(tmp_path, ports)), "--mtp", "0",
                                         "--topology", str(fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE))])
    started.append(run)
    assert run.up.returncode == 0, run.up.stdout + run.up.stderr
    bench = run.cli("bench", "--url", f"http://127.0.0.1:{ports[5]}", "--concurrency", "1", "--requests", "2",
                    "--output-len", "5", "--json")
    assert bench.returncode == 0 and json.loads(bench.stdout)["levels"][0]["accept_length"] is None
    assert "accept len" not in run.cli("bench", "--url", f"http://127.0.0.1:{ports[5]}", "--concurrency", "1",
                                       "--requests", "2", "--output-len", "5").stdout


def _two_decode_config(tmp: Path, p: list[int]) -> Path:
    return fakebox.write_pd_config(tmp, p, "2xtp2.toml", decodes=2)


def test_2xtp2_layout_behind_one_router_spreads_requests(tmp_path: Path, started: list[Run]) -> None:
    ports = fakebox.free_ports(9)
    topo = fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)
    run = Run(tmp_path, _env(tmp_path), ["--profile", "rtx6000-8x-pd-2xtp2", "--config",
                                         str(_two_decode_config(tmp_path, ports)), "--topology", str(topo)])
    started.append(run)
    assert run.up.returncode == 0, run.up.stdout + run.up.stderr
    router = f"http://127.0.0.1:{ports[7]}"
    workers = _get(router + "/workers")
    kinds = sorted((w["worker_type"], w["url"]) for w in workers["workers"] if w["is_healthy"])
    assert kinds == sorted([("prefill", f"http://127.0.0.1:{ports[0]}"), ("decode", f"http://127.0.0.1:{ports[3]}"),
                            ("decode", f"http://127.0.0.1:{ports[5]}")])
    for i in range(8):
        body = _post(router + "/generate", {"text": f"request {i} to the two decode replicas",
                                            "sampling_params": {"max_new_tokens": 4}})
        assert body["meta_info"]["completion_tokens"] == 4
    served = {}
    for name in ("decode-0", "decode-1"):
        recs = fakebox.json_records(run.log(name))
        served[name] = sum(1 for r in recs if r.get("path") == "/generate" and r.get("status") == 200
                           and r.get("bootstrap_room") is not None)
        assert any(r.get("rehearsal") == "room_received" for r in recs), name  # a real PD handoff on each
    assert served["decode-0"] >= 2 and served["decode-1"] >= 2 and sum(served.values()) >= 8, served
    # the plan it ran: decode-0 on GPUs 4,5 and decode-1 on 6,7 at TP2, both meant for NUMA node 1
    plan = json.loads((run.dir / "plan.json").read_text())
    dec = {p["name"]: p for p in plan["processes"] if p["role"] == "decode"}
    assert dec["decode-0"]["gpus"] == [4, 5] and dec["decode-1"]["gpus"] == [6, 7]
    for name, p in dec.items():
        env = dict(p["env"])
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, p["gpus"]))
        assert p["argv"][p["argv"].index("--tp-size") + 1] == "2"
        if Path("/sys/devices/system/node/node1").exists():
            assert p["binding"]["node"] == 1, name
        else:
            assert f"{name}: NUMA binding to node 1 skipped in rehearsal" in " ".join(w["text"] for w in plan["warnings"])
    assert {f["worker"]: f["tp"] for f in plan["memory"]} == {"prefill-0": 4, "decode-0": 2, "decode-1": 2}
