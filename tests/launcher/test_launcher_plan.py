"""The pure plan builder on fixture boxes, and `plan` on a fake box probed from outside the process."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import fakebox
import pytest
from fakebox import BOX_8GPU_2NODE

from v4flash_pd import topology as topo
from v4flash_pd.config.load import load_config
from v4flash_pd.errors import UserError
from v4flash_pd.host import Host, probe_host
from v4flash_pd.hostprobe import NodeProbe, probe_node
from v4flash_pd.model import check_model_dir
from v4flash_pd.plan import Plan, build_plan

FIXTURES = Path(__file__).parent / "fixtures"
NO_ENV: dict[str, str] = {}


def texts(plan: Plan | dict[str, Any]) -> list[str]:
    """A plan's warnings as words (a Plan, or its JSON form)."""
    if isinstance(plan, Plan):
        return [w.text for w in plan.warnings]
    return [w["text"] for w in plan["warnings"]]


def box(name: str) -> topo.Topology:
    return topo.load(FIXTURES / f"topology-{name}.json")


def local(topology: topo.Topology, nodes: tuple[int, ...] = (0, 1), numactl: str = "/usr/bin/numactl",
          membind: bool = True, preferred: bool = True, detail: str = "membind permitted", **kw) -> Host:
    """A local Host whose numactl probes came out as given (the probe itself is tested below)."""
    absent = tuple(NodeProbe(n, False, False, False, f"numactl cannot bind node {n} here") for n in (0, 1)
                   if n not in nodes)
    probes = tuple(NodeProbe(n, membind, preferred, True, detail) for n in nodes) + absent if numactl else ()
    return Host(topology=topology, local=True, python="/usr/bin/python3", numactl=numactl, allowed_nodes=nodes,
                nodes=probes, **kw)


def two_nodes(name: str = "8gpu-2node") -> Host:
    return local(box(name))


def one_node(name: str = "8gpu-2node") -> Host:
    return local(box(name), nodes=(0,))


def remote(name: str) -> Host:
    return Host.remote(box(name))


def cfg(*sets: str, profile: str | None = None):
    return load_config(profile=profile, env=NO_ENV, sets=sets)


def flag(argv, name: str) -> str:
    argv = list(argv)
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def engine_tail(argv) -> list[str]:
    """argv after the numactl prefix (from the interpreter on)."""
    argv = list(argv)
    return argv[argv.index("--") + 1:] if "--" in argv else argv


# ------------------------------------------------------------------ default profile, reference box


def test_default_profile_on_reference_box() -> None:
    plan = build_plan(cfg(), two_nodes("8gpu-2node"))
    assert [w.code for w in plan.warnings] == ["router-open"]  # router on 0.0.0.0
    assert "WITHOUT authentication" in plan.warnings[0].text
    p, d, r = plan.get("prefill-0"), plan.get("decode-0"), plan.get("router")
    assert [x.name for x in plan.processes] == ["prefill-0", "decode-0", "router"]
    assert list(p.argv[:4]) == ["/usr/bin/numactl", "--cpunodebind=0", "--membind=0", "--"]
    assert list(d.argv[:4]) == ["/usr/bin/numactl", "--cpunodebind=1", "--membind=1", "--"]
    assert r.argv[0] != "/usr/bin/numactl" and r.binding.policy == "none"
    pe, de = dict(p.env), dict(d.env)
    assert pe["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and de["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    for argv in (p.argv, d.argv):
        tail = engine_tail(argv)
        assert tail[1:3] == ["-m", "sglang.launch_server"]
        assert flag(argv, "--moe-runner-backend") == "marlin"
        assert flag(argv, "--kv-cache-dtype") == "fp8_e4m3"
        assert flag(argv, "--disaggregation-transfer-backend") == "nixl"
        assert flag(argv, "--tp-size") == "4" and "--dp-size" not in argv
        assert flag(argv, "--model-path") == "/models/DeepSeek-V4-Flash"
    assert flag(d.argv, "--cuda-graph-max-bs") == "64" and "--cuda-graph-max-bs" not in p.argv
    assert flag(p.argv, "--context-length") == flag(d.argv, "--context-length") == "131072"
    assert flag(p.argv, "--chunked-prefill-size") == "8192" and "--chunked-prefill-size" not in d.argv
    assert flag(p.argv, "--disaggregation-mode") == "prefill" and flag(d.argv, "--disaggregation-mode") == "decode"
    # explicit ports everywhere
    assert (flag(p.argv, "--port"), flag(p.argv, "--nccl-port"), flag(p.argv, "--disaggregation-bootstrap-port")) \
        == ("30000", "30010", "8998")
    assert (flag(d.argv, "--port"), flag(d.argv, "--nccl-port")) == ("30001", "30011")
    assert flag(d.argv, "--disaggregation-bootstrap-port") == "8998"  # decode's fallback = prefill-0's
    assert (flag(r.argv, "--port"), flag(r.argv, "--prometheus-port"), flag(r.argv, "--host")) \
        == ("8000", "29000", "0.0.0.0")
    assert {(u.owner, u.port) for u in plan.port_uses()} == {
        ("prefill-0 http", 30000), ("prefill-0 nccl", 30010), ("prefill-0 bootstrap", 8998),
        ("decode-0 http", 30001), ("decode-0 nccl", 30011),
        ("router http", 8000), ("router metrics", 29000)}
    rargv = list(r.argv)
    assert rargv[1:4] == ["-m", "sglang_router.launch_router", "--pd-disaggregation"]
    assert rargv[rargv.index("--prefill") + 1:rargv.index("--prefill") + 3] == ["http://127.0.0.1:30000", "8998"]
    assert flag(rargv, "--decode") == "http://127.0.0.1:30001"
    # offline + UCX env on both engines, not on the router
    for env in (pe, de):
        assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1" and env["HF_DATASETS_OFFLINE"] == "1"
        assert env["UCX_TLS"] == "cuda_copy,cuda_ipc,sm,tcp,self"
        assert env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] == "UCX"
        assert env.get("UCX_MODULE_DIR") != "auto"  # resolved or dropped, never passed literally
        assert env["V4FLASH_SPARSE_DECODE"] == env["V4FLASH_MOE"] == env["V4FLASH_INDEXER"] == "1"
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # CUDA indices = nvidia-smi indices
    assert "UCX_TLS" not in dict(r.env) and "CUDA_VISIBLE_DEVICES" not in dict(r.env)
    assert dict(r.env)["HF_HUB_OFFLINE"] == "1" and dict(r.env)["TRANSFORMERS_OFFLINE"] == "1"  # router offline too
    assert dict(r.env)["HF_ENDPOINT"] == "http://127.0.0.1:1"  # its Rust hub client reads only this one
    assert plan.expected == (("prefill", 1), ("decode", 1))
    assert plan.url == "http://0.0.0.0:8000" and plan.probe_url == "http://127.0.0.1:8000"


def test_plan_is_pure() -> None:
    a = build_plan(cfg(), two_nodes("8gpu-2node"))
    b = build_plan(cfg(), two_nodes("8gpu-2node"))
    assert a == b and a.to_dict() == b.to_dict()


def test_cli_plan_json_on_reference_box(topo_8x2: Path, plan_json) -> None:
    """Through the CLI with --topology (planning another box: no local NUMA checks)."""
    plan = plan_json("--topology", str(topo_8x2))
    assert plan["format"] == "v4flash-pd/plan/2"
    procs = {p["name"]: p for p in plan["processes"]}
    assert procs["prefill-0"]["argv"][:4] == ["numactl", "--cpunodebind=0", "--membind=0", "--"]
    assert procs["decode-0"]["argv"][:4] == ["numactl", "--cpunodebind=1", "--membind=1", "--"]
    assert dict(map(tuple, procs["decode-0"]["env"]))["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert all(isinstance(a, str) for p in plan["processes"] for a in p["argv"])
    # a plan for another box says nothing about this one (no model dir, ports or numactl of this host)
    assert [w["code"] for w in plan["warnings"]] == ["ucx-module-dir", "router-open"], plan["warnings"]
    assert "UCX_MODULE_DIR" in plan["warnings"][0]["text"] and "WITHOUT authentication" in plan["warnings"][1]["text"]


def test_plan_for_another_box_uses_no_fact_of_this_one(topo_8x2: Path, tmp_path: Path, plan_json) -> None:
    """No host leak: this machine's interpreter, nixl install, numactl and busy ports stay out."""
    import os

    site = tmp_path / "site"  # nixl "installed" here: must not reach another box's plan
    (site / "nixl_cu13").mkdir(parents=True)
    (site / "nixl_cu13" / "__init__.py").write_text("")
    (site / "nixl_cu13.libs" / "ucx").mkdir(parents=True)
    pp = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    shim = fakebox.make_numactl_shim(tmp_path, membind_ok=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # decode-0's port, busy here
        s.listen(1)
        busy = s.getsockname()[1]
        plan = plan_json("--topology", str(topo_8x2), "--set", f"decode.0.port={busy}",
                         extra_env={"PYTHONPATH": pp, "V4FLASH_NUMACTL": str(shim)})
    text = json.dumps(plan["processes"])
    assert sys.executable not in text and str(site) not in text and str(shim) not in text
    for p in plan["processes"]:
        argv = p["argv"]
        assert argv[argv.index("-m") - 1] == "python3"
    assert "UCX_MODULE_DIR" not in {k for p in plan["processes"] for k, _ in p["env"]}
    assert plan["local"] is False and not [w for w in texts(plan) if str(busy) in w]
    assert fakebox.read_argv_log(shim) == []  # numactl was never run for another box

# ------------------------------------------------------------------ NUMA contradictions


def test_contradicting_numa_map_is_an_error_naming_role_gpu_node() -> None:
    with pytest.raises(UserError) as e:
        build_plan(cfg(), remote("8gpu-swapped"))
    msg = e.value.message
    assert "prefill-0" in msg and "NUMA node 0" in msg and "[0, 1, 2, 3]" in msg and "node(s) [1]" in msg
    assert "--set prefill.0.numa_node=1" in e.value.hint and "--set numa=off" in e.value.hint


def test_contradicting_numa_map_via_cli(topo_swapped: Path, cli) -> None:
    res = cli("plan", "--topology", str(topo_swapped))
    assert res.returncode == 2
    assert "prefill-0" in res.stderr and "GPUs [0, 1, 2, 3]" in res.stderr and "node(s) [1]" in res.stderr
    assert "Traceback" not in res.stderr
    # the fix the message suggests works: follow the GPUs
    res = cli("plan", "--json", "--topology", str(topo_swapped),
              "--set", "prefill.0.numa_node=1", "--set", "decode.0.numa_node=0")
    assert res.returncode == 0, res.stderr
    procs = {p["name"]: p for p in json.loads(res.stdout)["processes"]}
    assert procs["prefill-0"]["argv"][1] == "--cpunodebind=1"


def test_unset_numa_node_follows_the_gpus() -> None:
    """With numa_node unset (TOML has no null, so via dataclasses.replace) binding follows the GPUs."""
    c = load_config(env=NO_ENV)
    workers = tuple(replace(w, numa_node=None) for w in c.workers)
    plan = build_plan(replace(c, workers=workers), remote("8gpu-swapped"))
    assert plan.get("prefill-0").binding.node == 1 and plan.get("decode-0").binding.node == 0
    assert plan.get("prefill-0").argv[1:3] == ("--cpunodebind=1", "--membind=1")


def test_numa_off_has_no_numactl_prefix() -> None:
    plan = build_plan(cfg("numa=off"), one_node("8gpu-swapped"))  # even a wrong map is fine when off
    for p in plan.workers():
        assert p.argv[1:3] == ("-m", "sglang.launch_server") and "numactl" not in " ".join(p.argv)
        assert p.binding.policy == "none"


def test_numa_preferred_mode() -> None:
    plan = build_plan(cfg("numa=preferred"), two_nodes("8gpu-2node"))
    assert list(plan.get("decode-0").argv[:4]) == ["/usr/bin/numactl", "--cpunodebind=1", "--preferred=1", "--"]
    assert not [w for w in texts(plan) if "NUMA" in w or "numactl" in w]


# ------------------------------------------------------------------ small boxes, rehearsal, strictness


def test_4gpu_box_real_up_refuses_plan_warns() -> None:
    with pytest.raises(UserError) as e:
        build_plan(cfg(), remote("4gpu-1node"), require_gpus=True)
    assert "GPUs [0, 1, 2, 3, 4, 5, 6, 7]" in e.value.message and "4 GPU(s)" in e.value.message
    assert "--topology" in e.value.hint
    plan = build_plan(cfg(), remote("4gpu-1node"), require_gpus=False)
    assert len([w for w in texts(plan) if "4 GPU(s)" in w]) == 1
    # default for a non-rehearsal build is strict
    with pytest.raises(UserError):
        build_plan(cfg(), remote("4gpu-1node"))


def test_4gpu_box_via_cli_only_warns(topo_4x1: Path, plan_json) -> None:
    plan = plan_json("--topology", str(topo_4x1))
    assert any("4 GPU(s)" in w and "[0, 1, 2, 3, 4, 5, 6, 7]" in w for w in texts(plan))


def test_rehearsal_on_one_node_host_skips_node1_with_one_line() -> None:
    plan = build_plan(cfg(), one_node("8gpu-2node"), rehearse=True)
    assert plan.get("prefill-0").argv[:4] == ("/usr/bin/numactl", "--cpunodebind=0", "--membind=0", "--")
    d = plan.get("decode-0")
    assert d.binding.node is None and "numactl" not in " ".join(d.argv)
    assert engine_tail(d.argv)[1:3] == ["-m", "v4flash_pd.rehearsal.engine"]
    lines = [w for w in texts(plan) if "NUMA" in w]
    assert len(lines) == 1 and "decode-0" in lines[0] and "node 1" in lines[0] and "rehearsal" in lines[0]
    assert "\n" not in lines[0]
    assert dict(d.env)["V4FLASH_REHEARSAL"] == "1"


def test_strict_plan_on_one_node_host_raises() -> None:
    with pytest.raises(UserError) as e:
        build_plan(cfg(), one_node("8gpu-2node"), require_gpus=True)
    assert "decode-0" in e.value.message and "node 1" in e.value.message and "numa" in e.value.hint
    # plan (not strict) keeps the intended binding and says `up` will refuse
    plan = build_plan(cfg(), one_node("8gpu-2node"), require_gpus=False)
    assert plan.get("decode-0").binding.node == 1
    assert [w for w in texts(plan) if "decode-0" in w and "up` will refuse" in w]


def test_no_numactl_on_host() -> None:
    host = local(box("8gpu-2node"), numactl="")
    with pytest.raises(UserError, match="numactl is not installed"):
        build_plan(cfg(), host, require_gpus=True)
    plan = build_plan(cfg(), host, rehearse=True)
    assert all(p.binding.policy == "none" for p in plan.workers())
    assert len([w for w in texts(plan) if "skipped in rehearsal" in w]) == 2


def probed_host(tmp_path: Path, box_name: str = "8gpu-2node", **shim) -> tuple[Path, Host]:
    """probe_host on a fixture topology with a numactl shim (which binds any node): the product's
    probe, run for real against the shim."""
    exe = fakebox.make_numactl_shim(tmp_path, **shim)
    return exe, probe_host(cfg(), env={"V4FLASH_NUMACTL": str(exe)}, topology=box(box_name))


def test_membind_refused_falls_back_to_preferred_loudly(tmp_path: Path) -> None:
    shim, host = probed_host(tmp_path, membind_ok=False)
    assert host.numactl == str(shim)
    n0 = host.node(0)
    assert n0 is not None and not n0.membind_ok and n0.preferred_ok  # this shim refuses only --membind
    assert "set_mempolicy: Operation not permitted" in n0.detail
    # the probe ran exactly the plan's prefixes (membind, then the preferred fallback) for both nodes
    calls = fakebox.read_argv_log(shim)
    for node in (0, 1):
        assert [f"--cpunodebind={node}", f"--membind={node}", "--", "true"] in calls
        assert [f"--cpunodebind={node}", f"--preferred={node}", "--", "true"] in calls
    plan = build_plan(cfg(), host, require_gpus=True)
    assert list(plan.get("prefill-0").argv[:4]) == [str(shim), "--cpunodebind=0", "--preferred=0", "--"]
    assert list(plan.get("decode-0").argv[:4]) == [str(shim), "--cpunodebind=1", "--preferred=1", "--"]
    loud = [w.text for w in plan.warned("numa-preferred")]
    assert len(loud) == 2 and all(w.startswith("WARNING") and "SYS_NICE" in w and "--preferred=" in w for w in loud)


def test_probe_argv_is_the_plans_prefix(tmp_path: Path) -> None:
    """The numactl probe and the plan share one builder: what was probed is what the worker gets."""
    shim, host = probed_host(tmp_path, membind_ok=True)
    plan = build_plan(cfg(), host, require_gpus=True)
    probed = fakebox.read_argv_log(shim)
    for p in plan.workers():
        prefix = list(p.argv[1:p.argv.index("--") + 1])
        assert prefix + ["true"] in probed, (prefix, probed)


def test_fallback_prefix_runs_in_a_container_without_sys_nice(tmp_path: Path) -> None:
    """Docker without CAP_SYS_NICE refuses --preferred as well: bind CPUs only, and say so."""
    shim, host = probed_host(tmp_path, membind_ok=False, preferred_ok=False)
    n1 = host.node(1)
    assert n1 is not None and not n1.membind_ok and not n1.preferred_ok and "--preferred refused too" in n1.detail
    plan = build_plan(cfg(), host, require_gpus=True)
    assert list(plan.get("decode-0").argv[:3]) == [str(shim), "--cpunodebind=1", "--"]
    loud = [w.text for w in plan.warned("numa-cpu-only")]
    assert len(loud) == 2 and all(w.startswith("WARNING") and "binding CPUs only" in w and "SYS_NICE" in w for w in loud)
    for p in plan.workers():
        assert p.binding.node is not None and p.binding.policy == "cpu"  # CPU binding is still possible and wanted
        prefix = list(p.argv[:p.argv.index("--") + 1])
        res = subprocess.run([*prefix, sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, (p.name, prefix, res.stderr)


def test_membind_permitted_by_shim(tmp_path: Path) -> None:
    shim = fakebox.make_numactl_shim(tmp_path, membind_ok=True)
    n = probe_node(str(shim), 1)
    assert n.membind_ok and n.detail == "membind permitted"
    assert fakebox.read_argv_log(shim) == [["--cpunodebind=1", "--membind=1", "--", "true"]]


def test_membind_refused_via_cli(tmp_path: Path, cli) -> None:
    """`plan` on a fake box whose numactl refuses membind (a container without CAP_SYS_NICE)."""
    env = fakebox.box_env(tmp_path, BOX_8GPU_2NODE, membind_ok=False)
    res = cli("plan", "--json", "--rehearse", env=env)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    procs = {p["name"]: p for p in plan["processes"]}
    shim = env["V4FLASH_NUMACTL"]
    assert procs["prefill-0"]["argv"][:4] == [shim, "--cpunodebind=0", "--preferred=0", "--"]
    assert [w for w in texts(plan) if w.startswith("WARNING prefill-0") and "SYS_NICE" in w]
    human = cli("plan", "--rehearse", env=env)
    assert "WARNING prefill-0: numactl --membind is not permitted here" in human.stdout


def test_real_numactl_rehearsal_plan_binds_what_the_host_has(tmp_path: Path, cli) -> None:
    """`plan --rehearse` on the fake 8-GPU box with this host's real numactl: every node the host
    lacks is skipped with exactly one line; nodes it has are bound with membind."""
    import shutil

    from v4flash_pd.hostprobe import allowed_mem_nodes

    env = fakebox.box_env(tmp_path, BOX_8GPU_2NODE)
    numactl = shutil.which("numactl")
    assert numactl, "numactl must be installed for the launcher tests (apt-get install numactl)"
    allowed = allowed_mem_nodes()
    plan = json.loads(cli("plan", "--json", "--rehearse", env=env).stdout)
    for p in plan["processes"]:
        if p["role"] == "router":
            continue
        node = p["binding"]["node"] if p["binding"]["node"] is not None else (0 if p["role"] == "prefill" else 1)
        skipped = [w for w in texts(plan) if w.startswith(p["name"]) and "skipped in rehearsal" in w]
        if node in allowed:
            membind = probe_node(numactl, node).membind_ok
            assert p["argv"][1:3] == [f"--cpunodebind={node}", f"--membind={node}" if membind
                                      else f"--preferred={node}"] and not skipped
        else:
            assert len(skipped) == 1 and p["argv"][1:3] == ["-m", "v4flash_pd.rehearsal.engine"]


# ------------------------------------------------------------------ validation


def test_gpu_overlap_between_roles() -> None:
    with pytest.raises(UserError) as e:
        build_plan(cfg("decode.0.gpus=[3,4,5,6]"), remote("8gpu-2node"))
    assert "GPU 3" in e.value.message and "prefill-0" in e.value.message and "decode-0" in e.value.message


def test_gpu_count_not_divisible_by_tp() -> None:
    with pytest.raises(UserError) as e:
        cfg("decode.0.gpus=[4,5,6]")
    assert "decode.0 has 3 GPUs" in e.value.message and "TP size 4" in e.value.message
    assert "--set decode.0.tp=N" in e.value.hint


def test_dp_when_more_gpus_than_tp() -> None:
    # each TP2 copy holds 86 GiB of weights per GPU: at the profile's 0.70 the memory check refuses it
    plan = build_plan(cfg("decode.0.tp=2", "decode.0.mem_fraction_static=0.94"), remote("8gpu-2node"))
    d = plan.get("decode-0").argv
    assert flag(d, "--tp-size") == "2" and flag(d, "--dp-size") == "2"


@pytest.mark.parametrize("item, owners", [
    ("decode.0.nccl_port=30010", ("prefill-0 nccl", "decode-0 nccl")),
    ("router.metrics_port=8998", ("prefill-0 bootstrap", "router metrics")),
    ("decode.0.port=8000", ("decode-0 http", "router http")),
])
def test_port_collision_inside_plan(item: str, owners: tuple[str, str]) -> None:
    with pytest.raises(UserError) as e:
        build_plan(cfg(item), remote("8gpu-2node"))
    port = item.split("=")[1]
    assert f"port {port} is used twice" in e.value.message
    assert all(o in e.value.message for o in owners)


def test_ipv6_wildcard_host_collides_with_everything() -> None:
    with pytest.raises(UserError, match="port 8000 is used twice"):
        build_plan(cfg("router.host=::", "decode.0.port=8000"), remote("8gpu-2node"))


def test_same_port_on_different_hosts_is_not_a_collision() -> None:
    plan = build_plan(cfg("prefill.0.host=127.0.0.2", "decode.0.nccl_port=30010"), remote("8gpu-2node"))
    assert flag(plan.get("decode-0").argv, "--nccl-port") == "30010"


def test_busy_port_reported_by_plan(tmp_path: Path, cli) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        env = fakebox.box_env(tmp_path, BOX_8GPU_2NODE)
        res = cli("plan", "--json", "--set", f"decode.0.port={port}", env=env)
        assert res.returncode == 0, res.stderr
        warnings = texts(json.loads(res.stdout))
        assert [w for w in warnings if f"{port} (decode-0 http on 127.0.0.1: already in use)" in w
                and "`up` will refuse" in w]
        # `up` refuses it before starting anything (rehearsal: no GPUs or model needed)
        up = cli("up", "--rehearse", "--set", f"decode.0.port={port}", env=env)
        assert up.returncode == 2 and f"{port} (decode-0 http on 127.0.0.1: already in use)" in up.stderr
        assert "Traceback" not in up.stderr and "run dir" not in up.stdout
    # once the listener is gone, the warning is gone too
    res = cli("plan", "--json", "--set", f"decode.0.port={port}", env=env)
    assert not [w for w in texts(json.loads(res.stdout)) if f"{port} (" in w]


def _adjacent_listeners(n: int) -> list[socket.socket]:
    """n listeners on consecutive ports of 127.0.0.1 (a few tries: another process may take one)."""
    for _ in range(20):
        held: list[socket.socket] = []
        base = fakebox.free_ports(1)[0]
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
                s.listen(1)
            return held
        except OSError:
            for s in held:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports on 127.0.0.1")


def test_a_busy_ports_fix_names_ports_that_are_free(tmp_path: Path, cli) -> None:
    """prefill-0 and decode-0 on two busy neighbouring ports, the router right above them: each --set of
    the fix names a port that is free, that no role uses and that the message does not list as busy."""
    held = _adjacent_listeners(2)
    try:
        a, b = (s.getsockname()[1] for s in held)
        env = fakebox.box_env(tmp_path, BOX_8GPU_2NODE)
        sets = (f"prefill.0.port={a}", f"decode.0.port={b}", f"router.port={b + 1}")
        roles = {u.port for u in load_config(env={}, sets=sets).port_uses()}
        up = cli("up", "--rehearse", *(w for x in sets for w in ("--set", x)), "--run-dir", str(tmp_path / "run"),
                 env=env)
        assert up.returncode == 2 and "Traceback" not in up.stderr, up.stderr
        head, _, fix = up.stderr.partition("fix: ")
        assert f"{a} (prefill-0 http" in head and f"{b} (decode-0 http" in head, up.stderr
        suggested = {key: int(port) for key, port in re.findall(r"--set ([a-z0-9_.]+port)=(\d+)", fix)}
        assert set(suggested) == {"prefill.0.port", "decode.0.port"}, fix
        assert len(set(suggested.values())) == 2 and not set(suggested.values()) & roles, (fix, roles)
        for port in suggested.values():
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(("127.0.0.1", port))  # free: it binds
    finally:
        for s in held:
            s.close()


# ------------------------------------------------------------------ model directory


def test_model_dir_missing_and_without_config(tmp_path: Path, cli) -> None:
    env = fakebox.box_env(tmp_path, BOX_8GPU_2NODE)  # planning this (fake) box: its model dir counts
    missing = tmp_path / "no-such-model"
    res = cli("plan", "--json", "--model", str(missing), env=env)
    assert res.returncode == 0, res.stderr
    w = texts(json.loads(res.stdout))
    assert [x for x in w if f"model directory {missing} does not exist" in x and "`up` will refuse" in x]
    empty = tmp_path / "empty-model"
    empty.mkdir()
    w = texts(json.loads(cli("plan", "--json", "--model", str(empty), env=env).stdout))
    assert [x for x in w if str(empty) in x and "config.json" in x]
    (empty / "config.json").write_text("{}")
    w = texts(json.loads(cli("plan", "--json", "--model", str(empty), env=env).stdout))
    assert not [x for x in w if "model" in x]


def test_model_path_that_is_a_file_says_so(tmp_path: Path, cli) -> None:
    env = fakebox.box_env(tmp_path, BOX_8GPU_2NODE)
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    w = texts(json.loads(cli("plan", "--json", "--model", str(f), env=env).stdout))
    assert [x for x in w if f"model path {f} is a file, not a directory" in x]
    up = cli("up", "--model", str(f), "--numa", "off", env=env)
    assert up.returncode == 2 and "is a file, not a directory" in up.stderr and "Traceback" not in up.stderr


def test_model_check_in_rehearsal_mentions_rehearsal(tmp_path: Path) -> None:
    host = replace(two_nodes("8gpu-2node"), model=check_model_dir(str(tmp_path / "x")))
    plan = build_plan(cfg(), host, rehearse=True)
    assert [w for w in texts(plan) if "does not exist" in w and "rehearsal does not load weights" in w]


def test_planned_numactl_prefix_runs_with_real_numactl(tmp_path: Path, cli) -> None:
    """The prefix `plan` writes for a node this host has is accepted by the real numactl."""
    env = fakebox.box_env(tmp_path, BOX_8GPU_2NODE)  # fake GPUs, real /usr/bin/numactl from PATH
    plan = json.loads(cli("plan", "--json", "--rehearse", env=env).stdout)
    bound = [p for p in plan["processes"] if p["binding"]["node"] is not None]
    assert bound, texts(plan)
    for p in bound:
        argv = p["argv"]
        prefix = argv[:argv.index("--") + 1]
        assert Path(prefix[0]).name == "numactl"
        code = "import os; print(sorted(os.sched_getaffinity(0)))"
        res = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, (prefix, res.stderr)
        want = topo.parse_cpulist(Path(f"/sys/devices/system/node/node{p['binding']['node']}/cpulist").read_text())
        got = set(json.loads(res.stdout))
        assert got and got <= set(want), (got, want)  # pinned to that node's CPUs


def test_workers_off_loopback_and_an_open_server_are_named() -> None:
    plan = build_plan(cfg("prefill.0.host=0.0.0.0", "router.metrics_host=10.0.0.5"), remote("8gpu-2node"))
    exposed = [w for w in texts(plan) if w.startswith("listening beyond this box")]
    assert len(exposed) == 1 and "prefill-0 bootstrap on 0.0.0.0:8998" in exposed[0]
    assert "router metrics on 10.0.0.5:29000" in exposed[0] and "decode-0" not in exposed[0]
    assert not [w for w in texts(build_plan(cfg(), remote("8gpu-2node"))) if w.startswith("listening beyond")]
    tp4 = build_plan(cfg(profile="rtx6000-tp4"), remote("8gpu-2node"))
    assert [w for w in texts(tp4) if w.startswith("server-0 listens on 0.0.0.0") and "WITHOUT authentication" in w]
