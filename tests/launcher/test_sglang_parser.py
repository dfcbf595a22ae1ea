"""The argv `plan` produces is accepted by the real parsers of the pinned sglang and sglang-router.

The engine side runs in an interpreter that imports the real `sglang==0.5.13.post1` wheel (CPU:
torch CPU + a torchvision stub, see tests/sglang_env.py); argparse is the only validation SGLang can
do without a GPU (ServerArgs.__post_init__ needs one), which is exactly what catches a wrong flag name
or choice before a 20-minute weight load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from v4flash_pd.config import keys as cfgmod
from v4flash_pd.config.values import MAX_PREFILL_CHUNK

BIN = Path(sys.executable).parent / "v4flash-pd"

PARSE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
plan = json.load(open(sys.argv[1]))
out = {}
for p in plan["processes"]:
    if p["role"] == "router":
        continue
    argv = p["argv"]
    args = argv[argv.index("sglang.launch_server") + 1:]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(args)
    out[p["name"]] = {k: getattr(ns, k) for k in (
        "model_path", "tensor_parallel_size", "host", "port", "nccl_port", "kv_cache_dtype",
        "moe_runner_backend", "mem_fraction_static", "cuda_graph_max_bs", "enable_metrics",
        "disaggregation_mode", "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
        "trust_remote_code", "context_length", "chunked_prefill_size")}
choices = {}
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
for a in parser._actions:
    if a.dest in ("disaggregation_transfer_backend", "kv_cache_dtype", "moe_runner_backend"):
        choices[a.dest] = list(a.choices)
print("RESULT " + json.dumps({"workers": out, "choices": choices}))
"""


@pytest.fixture(scope="module")
def default_plan(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("plan")
    topo = tmp / "topo.json"
    topo.write_text(json.dumps({
        "gpus": [{"index": i, "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "bus_id": f"0000:{0x17 + i:02x}:00.0",
                  "numa_node": 0 if i < 4 else 1, "compute_cap": "12.0"} for i in range(8)],
        "nodes": [{"id": 0, "cpus": "0-31"}, {"id": 1, "cpus": "32-63"}]}))
    res = subprocess.run([str(BIN), "plan", "--json", "--topology", str(topo)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    path = tmp / "plan.json"
    path.write_text(res.stdout)
    return path, json.loads(res.stdout)


def test_engine_argv_accepted_by_pinned_sglang_parser(default_plan, sglang_python) -> None:
    path, plan = default_plan
    res = subprocess.run([str(sglang_python), "-c", PARSE, str(path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    pre, dec = got["workers"]["prefill-0"], got["workers"]["decode-0"]
    assert pre["tensor_parallel_size"] == 4 and dec["tensor_parallel_size"] == 4
    assert pre["disaggregation_mode"] == "prefill" and dec["disaggregation_mode"] == "decode"
    assert pre["disaggregation_transfer_backend"] == dec["disaggregation_transfer_backend"] == "nixl"
    assert pre["disaggregation_bootstrap_port"] == 8998 == dec["disaggregation_bootstrap_port"]
    assert pre["kv_cache_dtype"] == "fp8_e4m3" and pre["moe_runner_backend"] == "marlin"
    assert dec["cuda_graph_max_bs"] == 32 and pre["cuda_graph_max_bs"] is None
    assert (pre["port"], dec["port"], pre["nccl_port"], dec["nccl_port"]) == (30000, 30001, 30010, 30011)
    assert pre["trust_remote_code"] and pre["enable_metrics"]
    assert pre["context_length"] == dec["context_length"] == 131072
    assert pre["chunked_prefill_size"] == 8192 <= MAX_PREFILL_CHUNK  # the profile's, under the sm_120 limit
    assert dec["chunked_prefill_size"] is None
    # the choices `plan` checks in milliseconds are the pinned parser's, exactly
    assert got["choices"]["disaggregation_transfer_backend"] == list(cfgmod.TRANSFER_BACKENDS)
    assert got["choices"]["kv_cache_dtype"] == list(cfgmod.KV_CACHE_DTYPES)
    assert got["choices"]["moe_runner_backend"] == list(cfgmod.MOE_RUNNER_BACKENDS)


def test_engine_parser_rejects_what_plan_rejects(sglang_python, tmp_path) -> None:
    """Both refuse a transfer backend of 'ucx': the parser with SystemExit(2), plan before anything runs."""
    code = ("import argparse; from sglang.srt.server_args import ServerArgs; p=argparse.ArgumentParser(); "
            "ServerArgs.add_cli_args(p); p.parse_args(['--model-path','m','--disaggregation-transfer-backend','ucx'])")
    res = subprocess.run([str(sglang_python), "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "invalid choice: 'ucx'" in res.stderr
    plan = subprocess.run([str(BIN), "plan", "--set", "engine.transfer_backend=ucx"], capture_output=True, text=True,
                          timeout=60)
    assert plan.returncode == 2 and "transfer_backend = 'ucx'" in plan.stderr


def test_router_argv_accepted_by_pinned_router_parser(default_plan) -> None:
    import argparse
    import importlib.metadata

    from sglang_router.launch_router import RouterArgs

    assert importlib.metadata.version("sglang-router") == "0.3.2"
    _, plan = default_plan
    router = next(p for p in plan["processes"] if p["role"] == "router")
    argv = router["argv"]
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[argv.index("sglang_router.launch_router") + 1:])
    ra = RouterArgs.from_cli_args(ns)
    assert ra.pd_disaggregation is True
    assert ra.prefill_urls == [("http://127.0.0.1:30000", 8998)]
    assert ra.decode_urls == ["http://127.0.0.1:30001"]
    assert (ra.host, ra.port, ra.prometheus_host, ra.prometheus_port) == ("0.0.0.0", 8000, "127.0.0.1", 29000)
