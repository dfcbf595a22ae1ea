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
        "trust_remote_code", "context_length", "chunked_prefill_size", "speculative_algorithm",
        "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")}
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
    assert dec["cuda_graph_max_bs"] == 64 and pre["cuda_graph_max_bs"] is None
    # MTP on by default: the pinned parser reads the same 2-step EAGLE flags on both workers
    for w in (pre, dec):
        assert (w["speculative_algorithm"], w["speculative_num_steps"], w["speculative_eagle_topk"],
                w["speculative_num_draft_tokens"]) == ("EAGLE", 2, 1, 3)
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


# ------------------------------------------------------------------ speculative decoding (issue 22)

HOOKS = r"""
import argparse, json, sys
from types import SimpleNamespace
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups.deepseek_v4_hook import apply_deepseek_v4_defaults
from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
from sglang.srt.arg_groups.speculative_hook import handle_speculative_decoding
FIELDS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
out = {}
for name, args in json.load(open(sys.argv[1])).items():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(args)
    parsed = {k: getattr(ns, k) for k in FIELDS}
    # ServerArgs.__post_init__ needs a GPU; run its speculative steps in its order on the parsed fields
    sa = object.__new__(ServerArgs)
    sa.__dict__.update(vars(ns))
    sa.get_model_config = lambda: SimpleNamespace(hf_config=SimpleNamespace(architectures=["DeepseekV4ForCausalLM"]))
    try:
        apply_deepseek_v4_defaults(sa, "DeepseekV4ForCausalLM")
        handle_pd_disaggregation(sa)
        handle_speculative_decoding(sa)
        error = ""
    except (AssertionError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    out[name] = {"parsed": parsed, "after": {k: getattr(sa, k) for k in FIELDS}, "error": error}
print("RESULT " + json.dumps(out))
"""


def _plan(tmp: Path, *args: str) -> dict:
    topo = tmp / "topo.json"
    if not topo.exists():
        topo.write_text(json.dumps({
            "gpus": [{"index": i, "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "numa_node": i // 4,
                      "bus_id": f"0000:{0x17 + i:02x}:00.0", "compute_cap": "12.0"} for i in range(8)],
            "nodes": [{"id": 0, "cpus": "0-31"}, {"id": 1, "cpus": "32-63"}]}))
    res = subprocess.run([str(BIN), "plan", "--json", "--topology", str(topo), *args], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _engine_args(plan: dict, name: str) -> list[str]:
    argv = next(p["argv"] for p in plan["processes"] if p["name"] == name)
    return argv[argv.index("sglang.launch_server") + 1:]


def _edit(args: list[str], flag: str, value: str | None) -> list[str]:
    """The argv with `flag`'s value replaced (None: the flag and its value removed)."""
    i = args.index(flag)
    return args[:i] + args[i + 2:] if value is None else args[:i + 1] + [value] + args[i + 2:]


def test_speculative_argv_passes_the_pinned_hooks_and_what_plan_refuses_fails_them(tmp_path, sglang_python) -> None:
    """`plan --mtp 3` argv: accepted by the real parser and the real DeepSeek-V4 / PD / speculative hooks,
    unchanged by them. The same argv with what the launcher refuses: the real hooks stop it (or silently
    change it), and `plan` refuses the config that would produce it."""
    pd = _plan(tmp_path, "--mtp", "3")
    agg = _plan(tmp_path, "--mtp", "3", "--profile", "rtx6000-tp4")
    dec = _engine_args(pd, "decode-0")
    cases = {
        "prefill": _engine_args(pd, "prefill-0"), "decode": dec, "server": _engine_args(agg, "server-0"),
        "nextn": _edit(dec, "--speculative-algorithm", "NEXTN"),
        "lowercase": _edit(dec, "--speculative-algorithm", "eagle"),
        "topk2": _edit(dec, "--speculative-eagle-topk", "2"),
        "no-topk": _edit(dec, "--speculative-eagle-topk", None),
        "draft6": _edit(dec, "--speculative-num-draft-tokens", "6"),
        "radix": dec + ["--disaggregation-decode-enable-radix-cache"],
    }
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    res = subprocess.run([str(sglang_python), "-c", HOOKS, str(path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    want = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4}
    for name in ("prefill", "decode", "server"):
        assert got[name]["error"] == "", (name, got[name])
        assert got[name]["parsed"] == want == got[name]["after"], name  # the hooks keep what the plan wrote
    assert "Only EAGLE speculative algorithm is supported" in got["nextn"]["error"]
    assert "Only EAGLE speculative algorithm is supported" in got["lowercase"]["error"]
    assert "topk == 1" in got["topk2"]["error"] and "topk == 1" in got["no-topk"]["error"]
    assert got["draft6"]["error"] == "" and got["draft6"]["parsed"]["speculative_num_draft_tokens"] == 6
    assert got["draft6"]["after"]["speculative_num_draft_tokens"] == 4  # silently changed: why plan refuses it
    assert got["radix"]["error"].startswith("ValueError") and "incompatible with speculative" in got["radix"]["error"]
    # and `plan` refuses each config that would write those argvs
    for sets in (("speculative.algorithm=NEXTN",), ("speculative.algorithm=eagle",), ("speculative.eagle_topk=2",),
                 ("speculative.num_draft_tokens=6",),
                 ('decode.0.extra_args=["--disaggregation-decode-enable-radix-cache"]',)):
        res = subprocess.run([str(BIN), "plan", "--mtp", "3", *(x for s in sets for x in ("--set", s))],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and res.stderr.startswith("error: ") and "fix: " in res.stderr, (sets, res.stderr)


def test_2xtp2_router_argv_accepted_by_pinned_router_parser(tmp_path) -> None:
    import argparse

    from sglang_router.launch_router import RouterArgs

    plan = _plan(tmp_path, "--profile", "rtx6000-8x-pd-2xtp2")
    argv = next(p["argv"] for p in plan["processes"] if p["role"] == "router")
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    ra = RouterArgs.from_cli_args(parser.parse_args(argv[argv.index("sglang_router.launch_router") + 1:]))
    assert ra.decode_urls == ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    assert ra.prefill_urls == [("http://127.0.0.1:30000", 8998)] and ra.decode_policy == "round_robin"
