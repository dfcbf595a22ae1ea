"""doctor: each fixture box gives the expected status and fix text, through the real CLI."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ops_doctor_fixtures import make_model, make_numactl_docker, make_numactl_ok, make_nvidia_smi, make_sysfs, write_lock

from v4flash_pd.config.load import load_config
from v4flash_pd.doctor import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_WARN,
    DoctorInput,
    exit_code,
    expect_from_plan,
    render_table,
    run_checks,
    system_probe,
)
from v4flash_pd.doctor import model as dmodel
from v4flash_pd.doctor import numa as dnuma
from v4flash_pd.doctor import storage as dstorage
from v4flash_pd.doctor import transport as dtransport
from v4flash_pd.doctor.result import Check
from v4flash_pd.host import probe_host
from v4flash_pd.plan import build_plan
from v4flash_pd.ports import free_port

PORT_KEYS = ("prefill.0.port", "prefill.0.nccl_port", "prefill.0.bootstrap_port", "decode.0.port",
             "decode.0.nccl_port", "router.port", "router.metrics_port")


@pytest.fixture
def box(tmp_path):
    """A healthy 8-GPU / 2-socket box: returns (env, ports, model dir, tmp)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ports = {}
    while len(set(ports.values())) < len(PORT_KEYS):
        ports = {k: free_port() for k in PORT_KEYS}
    lock = write_lock(tmp_path / "stack.lock", {
        "click": importlib.metadata.version("click"), "pytest": importlib.metadata.version("pytest")})
    env = dict(os.environ)
    env.update({
        "V4FLASH_SYSFS_ROOT": str(make_sysfs(tmp_path / "sys")),
        "V4FLASH_NVIDIA_SMI": str(make_nvidia_smi(bin_dir)),
        "V4FLASH_NUMACTL": str(make_numactl_ok(bin_dir)),
        # a healthy box keeps the router on loopback (on 0.0.0.0 without a key, router-auth warns)
        "V4FLASH_SET": " ".join(f"{k}={v}" for k, v in ports.items()) + " router.host=127.0.0.1",
        "V4FLASH_STACK_LOCK": str(lock),
        "V4FLASH_SHM_PATH": str(tmp_path),  # the real /dev/shm size depends on the CI container
        "HOME": str(tmp_path / "home"),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    })
    for k in ("V4FLASH_MODEL_MANIFEST", "UCX_TLS", "SGLANG_CACHE_DIR"):
        env.pop(k, None)
    return {"env": env, "ports": ports, "model": make_model(tmp_path / "models"), "tmp": tmp_path, "bin": bin_dir}


def doctor(box, *args, **env_over):
    env = dict(box["env"], **env_over)
    p = subprocess.run([sys.executable, "-m", "v4flash_pd", "doctor", "--model", str(box["model"]), "--json", *args],
                       capture_output=True, text=True, timeout=180, env=env)
    assert p.stdout.strip(), p.stderr
    doc = json.loads(p.stdout)
    assert doc["exit_code"] == p.returncode
    return p.returncode, {c["name"]: c for c in doc["checks"]}


def test_healthy_box_is_all_ok(box):
    rc, checks = doctor(box)
    bad = {n: c for n, c in checks.items() if c["status"] not in ("ok", "skip")}
    assert rc == EXIT_OK and not bad, bad
    assert "580.95.05" in checks["nvidia-driver"]["detail"]
    assert "8 x NVIDIA RTX PRO 6000" in checks["gpus"]["detail"] and "sm_120" in checks["gpus"]["detail"]
    assert "GPU0->0" in checks["gpu-numa"]["detail"] and "GPU7->1" in checks["gpu-numa"]["detail"]
    assert checks["numa-membind"]["status"] == "ok" and "node(s) [0, 1]" in checks["numa-membind"]["detail"]
    assert checks["router-auth"]["status"] == "ok" and "127.0.0.1 only" in checks["router-auth"]["detail"]
    for name in ("ports", "model-dir", "model-tokenizer", "model-weights", "model-manifest", "stack-versions",
                 "nixl", "ucx-transports", "offline-env", "cache-disk", "shm"):
        assert checks[name]["status"] == "ok", checks[name]
    # the real code ran the fake tools: nvidia-smi queried, numactl asked to membind each planned node
    calls = [json.loads(x) for x in (box["bin"] / "numactl.log").read_text().splitlines()]
    assert ["--cpunodebind=0", "--membind=0", "--", "true"] in calls
    assert ["--cpunodebind=1", "--membind=1", "--", "true"] in calls


def test_no_cap_sys_nice_warns_with_the_docker_flag(box):
    rc, checks = doctor(box, V4FLASH_NUMACTL=str(make_numactl_docker(box["tmp"] / "bin")))
    c = checks["numa-membind"]
    assert rc == EXIT_WARN and c["status"] == "warn"
    assert "Operation not permitted" in c["detail"] and "cpunodebind only" in c["detail"]  # the plan's fallback
    assert "--cap-add SYS_NICE" in c["fix"]


def test_real_numactl_on_this_one_node_vm(box):
    """The real numactl: node 0 binds, node 1 does not exist here -> error naming the node."""
    real = subprocess.run(["which", "numactl"], capture_output=True, text=True).stdout.strip()
    assert real, "numactl must be installed for the doctor tests (apt-get install numactl)"
    rc, checks = doctor(box, V4FLASH_NUMACTL=real)
    c = checks["numa-membind"]
    assert rc == EXIT_ERROR and c["status"] == "error"
    assert "decode-0 (--cpunodebind=1 --membind=1)" in c["detail"] and "prefill-0" not in c["detail"]
    assert "numa_node" in c["fix"]


def test_gpu_numa_map_contradicting_the_plan(box):
    """The profile pins prefill to node 0; GPUs 0-3 sit on node 1 here: the plan itself cannot be
    built, and that is doctor's finding (one `plan` row naming both workers and the fixes)."""
    flipped = make_sysfs(box["tmp"] / "sys-flipped", gpu_nodes=[1, 1, 1, 1, 0, 0, 0, 0])
    rc, checks = doctor(box, V4FLASH_SYSFS_ROOT=str(flipped))
    c = checks["plan"]
    assert rc == EXIT_ERROR and c["status"] == "error" and list(checks) == ["plan"]
    assert "prefill-0 is bound to NUMA node 0 but its GPUs [0, 1, 2, 3] sit on node(s) [1]" in c["detail"]
    assert "--set prefill.0.numa_node=1" in c["fix"] and "--set decode.0.numa_node=0" in c["fix"]
    # following the fix makes the map check pass
    rc, checks = doctor(box, "--only", "gpu", "--set", "prefill.0.numa_node=1", "--set", "decode.0.numa_node=0",
                        V4FLASH_SYSFS_ROOT=str(flipped))
    assert checks["gpu-numa"]["status"] == "ok", checks["gpu-numa"]


def test_unknown_numa_node_is_a_warning(box):
    vm = make_sysfs(box["tmp"] / "sys-vm", gpu_nodes=[-1] * 8)
    rc, checks = doctor(box, "--only", "gpu", V4FLASH_SYSFS_ROOT=str(vm))
    assert rc == EXIT_WARN and checks["gpu-numa"]["status"] == "warn" and "-1" in checks["gpu-numa"]["detail"]


def test_busy_port(box):
    port = box["ports"]["decode.0.port"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen(1)
        rc, checks = doctor(box, "--only", "ports")
    c = checks["ports"]
    assert rc == EXIT_ERROR and c["status"] == "error"
    assert f"decode-0 http 127.0.0.1:{port} (already in use)" in c["detail"]
    assert f"sport = :{port}" in c["fix"]
    rc, checks = doctor(box, "--only", "ports")  # released -> ok again
    assert rc == EXIT_OK and checks["ports"]["status"] == "ok"


def test_truncated_shard_vs_manifest(box):
    shard = box["model"] / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    rc, checks = doctor(box, "--only", "model")
    assert rc == EXIT_ERROR
    w, m = checks["model-weights"], checks["model-manifest"]
    assert w["status"] == "error" and "model-00002-of-00002.safetensors: truncated" in w["detail"]
    assert m["status"] == "error" and "manifest says" in m["detail"] and "bundle load --model" in m["fix"]


def test_missing_shard_and_missing_model(box):
    (box["model"] / "model-00001-of-00002.safetensors").unlink()
    rc, checks = doctor(box, "--only", "model")
    assert rc == EXIT_ERROR and "1 of 2 shard(s)" in checks["model-weights"]["detail"]
    p = subprocess.run([sys.executable, "-m", "v4flash_pd", "doctor", "--json", "--only", "model", "--model",
                        str(box["tmp"] / "nope")], capture_output=True, text=True, timeout=60, env=box["env"])
    doc = {c["name"]: c for c in json.loads(p.stdout)["checks"]}
    assert p.returncode == EXIT_ERROR and doc["model-dir"]["status"] == "error" and doc["model-weights"]["status"] == "skip"


def test_version_drift_from_the_lock(box):
    lock = write_lock(box["tmp"] / "drift.lock", {"click": "0.0.1", "pytest": importlib.metadata.version("pytest")})
    rc, checks = doctor(box, "--only", "stack", V4FLASH_STACK_LOCK=str(lock))
    c = checks["stack-versions"]
    assert rc == EXIT_ERROR and c["status"] == "error"
    assert f"click {importlib.metadata.version('click')} (lock 0.0.1)" in c["detail"]
    assert "--require-hashes -r" in c["fix"] and str(lock) in c["fix"]


def test_old_driver_and_wrong_gpu(box):
    rc, checks = doctor(box, "--only", "gpu",
                        V4FLASH_NVIDIA_SMI=str(make_nvidia_smi(box["tmp"], name="NVIDIA H200", cap="9.0",
                                                               driver="570.86.15")))
    assert rc == EXIT_ERROR
    assert checks["nvidia-driver"]["status"] == "error" and "needs >= 580" in checks["nvidia-driver"]["detail"]
    assert checks["gpus"]["status"] == "error" and "sm_120" in checks["gpus"]["detail"]


def test_too_few_gpus(box):
    rc, checks = doctor(box, "--only", "gpu", V4FLASH_NVIDIA_SMI=str(make_nvidia_smi(box["tmp"], count=4)))
    assert rc == EXIT_ERROR and "only [0, 1, 2, 3] exist" in checks["gpus"]["detail"]


def test_no_nvidia_smi_and_offline_env_unset(box):
    env = {k: v for k, v in box["env"].items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["V4FLASH_NVIDIA_SMI"] = str(box["tmp"] / "missing-nvidia-smi")
    cfg = box["tmp"] / "c.toml"
    cfg.write_text("[env]\nHF_HUB_OFFLINE = \"0\"\n")
    p = subprocess.run([sys.executable, "-m", "v4flash_pd", "doctor", "--json", "--only", "gpu,offline",
                        "--config", str(cfg)], capture_output=True, text=True, timeout=60, env=env)
    doc = {c["name"]: c for c in json.loads(p.stdout)["checks"]}
    assert p.returncode == EXIT_ERROR
    assert doc["nvidia-driver"]["status"] == "error" and "driver" in doc["nvidia-driver"]["fix"]
    # the profile's env sets TRANSFORMERS_OFFLINE=1; the config file turned HF_HUB_OFFLINE off
    assert doc["offline-env"]["status"] == "warn" and "HF_HUB_OFFLINE" in doc["offline-env"]["detail"]
    assert "TRANSFORMERS_OFFLINE" not in doc["offline-env"]["detail"]


def test_table_output_and_exit_codes(box):
    p = subprocess.run([sys.executable, "-m", "v4flash_pd", "doctor", "--model", str(box["model"]),
                        "--only", "gpu,numa"], capture_output=True, text=True, timeout=60,
                       env=dict(box["env"], V4FLASH_NUMACTL=str(make_numactl_docker(box["tmp"] / "bin"))))
    assert p.returncode == EXIT_WARN == 3
    assert "numa-membind" in p.stdout and "WARN" in p.stdout and "fix: give the container CAP_SYS_NICE" in p.stdout
    p = subprocess.run([sys.executable, "-m", "v4flash_pd", "doctor", "--only", "bogus"], capture_output=True,
                       text=True, timeout=60, env=box["env"])
    assert p.returncode == 2 and "unknown check family" in p.stderr  # a usage error, not a finding
    assert exit_code([Check("a", "ok", "")]) == 0
    assert exit_code([Check("a", "ok", ""), Check("b", "warn", "", "f"), Check("c", "skip", "")]) == 3
    assert exit_code([Check("a", "warn", "", "f"), Check("b", "error", "", "f")]) == EXIT_ERROR == 4


# ---- seam-level tests: the same checks fed a probe with one thing replaced


def _inp(box, **probe_over) -> DoctorInput:
    probe = system_probe(box["env"])
    probe = dataclasses.replace(probe, **probe_over)
    cfg = load_config(overrides={"model.path": str(box["model"])}, env=box["env"])
    host = probe_host(cfg, env=box["env"])
    plan = build_plan(cfg, host, require_gpus=False)
    expect = expect_from_plan(plan, host, numa_mode=cfg.numa, transfer_backend=cfg.transfer_backend)
    return DoctorInput(expect=expect, topology=host.topology, probe=probe)


def test_small_dev_shm_is_an_error(box):
    inp = _inp(box, env=dict(box["env"], V4FLASH_SHM_PATH="/dev/shm"),
               disk_free=lambda p: ("/dev/shm", 60 * 2**20, 64 * 2**20) if p == "/dev/shm" else ("/", 10**12, 10**12))
    c = dstorage.check_shm(inp)
    assert c.status == "error" and "--shm-size" in c.fix and "64 MiB" in c.detail
    inp = _inp(box, disk_free=lambda p: (p, 2**30, 10 * 2**30))  # 1 GiB free for caches
    c = dstorage.check_cache_disk(inp)
    assert c.status == "error" and "SGLANG_CACHE_DIR" in c.fix


def test_a_crashing_family_becomes_an_error_row(box):
    def boom(_inp):
        raise RuntimeError("kaput")

    checks = run_checks(_inp(box), families=(("gpu", boom),))
    assert len(checks) == 1 and checks[0].status == "error" and "kaput" in checks[0].detail
    assert "ERROR" in render_table(checks)


def test_nixl_missing_and_ucx_without_cuda_module(box, tmp_path):
    inp = _inp(box, has_module=lambda n: False if n.startswith("nixl") else True)
    c = dtransport.check_nixl(inp)
    assert c.status == "error" and "nixl-cu13==1.5.1" in c.fix
    moddir = tmp_path / "ucx"
    moddir.mkdir()
    (moddir / "libuct_cma.so.0.0.0").write_bytes(b"")
    inp = _inp(box, env=dict(box["env"], UCX_MODULE_DIR=str(moddir)), which=lambda n: None)
    inp = dataclasses.replace(inp, expect=dataclasses.replace(inp.expect, worker_env={
        **inp.expect.worker_env, "UCX_MODULE_DIR": str(moddir)}))
    c = dtransport.check_ucx(inp)
    assert c.status == "error" and "cuda_copy" in c.detail and "UCX_MODULE_DIR" in c.fix
    assert dtransport.parse_ucx_transports("#      Transport: cuda_copy\n#   Transport: tcp\n# Transport: tcp") == (
        "cuda_copy", "tcp")


def test_membind_failure_classification():
    assert dnuma.classify_membind_failure("set_mempolicy: Operation not permitted") == "perm"
    assert dnuma.classify_membind_failure("libnuma: Warning: node argument 1 is out of range") == "node"
    assert dnuma.classify_membind_failure("segfault") == "other"


def test_safetensors_header_check(tmp_path):
    from ops_doctor_fixtures import safetensors_bytes

    p = tmp_path / "x.safetensors"
    data = safetensors_bytes({"w": 700})
    p.write_bytes(data)
    assert dmodel.safetensors_problem(p) == ""
    p.write_bytes(data + b"xx")
    assert "trailing" in dmodel.safetensors_problem(p)
    p.write_bytes(data[:20])
    assert "does not fit" in dmodel.safetensors_problem(p)
    p.write_bytes(b"\x01\x00")
    assert "too short" in dmodel.safetensors_problem(p)


def _fake_sglang(root: Path, body: str) -> Path:
    mod = root / "sglang" / "srt" / "layers" / "attention"
    mod.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", root / "sglang" / "srt" / "layers", mod):
        (d / "__init__.py").write_text("")
    (mod / "flash_mla_sm120_triton.py").write_text(body)
    return root


def test_each_patch_is_reported_from_the_hooks_own_status(box):
    """doctor runs `python -m v4flash_kernels.hook.hook` in the workers' env: one row per patch, the switch
    taken from the plan (here sglang is importable but the hook's .pth is not installed: not applied)."""
    site = _fake_sglang(box["tmp"] / "fake-upstream", "def flash_mla_sparse_decode_triton(*a, **k):\n    pass\n")
    rc, checks = doctor(box, "--only", "stack", PYTHONPATH=str(site))
    assert {"patch-sparse_decode", "patch-moe", "patch-indexer", "context-length"} <= set(checks)
    c = checks["patch-sparse_decode"]
    assert c["status"] == "error" and "sparse-MLA decode patch NOT applied" in c["detail"]
    assert ".pth hook NOT loaded" in c["detail"] and ".pth is in site-packages" in c["fix"]
    assert "--sparse-decode off" in c["fix"]
    rc, checks = doctor(box, "--only", "stack", "--sparse-decode", "off", PYTHONPATH=str(site))
    assert checks["patch-sparse_decode"]["status"] == "ok"
    assert "off (V4FLASH_SPARSE_DECODE=0)" in checks["patch-sparse_decode"]["detail"]
    assert checks["patch-moe"]["status"] == "error"  # still on, still not applied: reported on its own


def test_indexer_off_with_a_long_context_warns(box):
    rc, checks = doctor(box, "--only", "stack", "--indexer", "off")
    c = checks["context-length"]
    assert c["status"] == "warn" and "131072" in c["detail"] and "--indexer on" in c["fix"]
    rc, checks = doctor(box, "--only", "stack", "--indexer", "off", "--set", "engine.context_length=32768")
    assert checks["context-length"]["status"] == "ok"
    rc, checks = doctor(box, "--only", "stack")
    assert checks["context-length"]["status"] == "ok"


def test_doctor_takes_exactly_ups_options():
    """One option set: every option `up` has, `doctor` has too (same names, same env vars)."""
    from v4flash_pd.cli import cmd_doctor, cmd_up

    def opts(cmd):
        return {(tuple(p.opts), p.envvar) for p in cmd.params if isinstance(p, __import__("click").Option)}

    assert opts(cmd_up.command) <= opts(cmd_doctor.command)
    names = {o for ops, _ in opts(cmd_up.command) for o in ops}
    assert {"--set", "--numa", "--sparse-decode", "--moe", "--indexer", "--rehearse", "--topology"} <= names


def test_ucx_info_without_cuda_ipc_warns(box):
    ucx = box["bin"] / "ucx_info"
    ucx.write_text("#!/bin/sh\nprintf '#      Transport: cuda_copy\\n#      Transport: tcp\\n#      Transport: sm\\n'\n")
    ucx.chmod(0o755)
    rc, checks = doctor(box, "--only", "transport", PATH=f"{box['bin']}:{os.environ['PATH']}")
    c = checks["ucx-transports"]
    assert c["status"] == "warn" and "no cuda_ipc" in c["detail"] and "ucx_info -d" in c["detail"]


def test_plan_warnings_no_other_row_covers_are_a_plan_row(box):
    rc, checks = doctor(box)
    assert checks["plan"]["status"] == "ok"
    rc, checks = doctor(box, "--set", "prefill.0.host=0.0.0.0")
    c = checks["plan"]
    assert rc == EXIT_WARN and c["status"] == "warn" and "prefill-0 bootstrap on 0.0.0.0" in c["detail"]


def test_doctor_rehearse_does_not_fail_on_what_a_rehearsal_does_not_need(tmp_path: Path) -> None:
    """Issue 23: `doctor --rehearse` exited 4 on GPU, model and NIXL findings a rehearsal never touches
    (here: a 4-GPU, one-node box and no model dir). They are shown as skipped rows that say why; what a
    rehearsal does need (ports) still fails it."""
    import fakebox

    ports = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, ports)
    env = fakebox.box_env(tmp_path, fakebox.BOX_4GPU_1NODE, membind_ok=True)

    def run(*extra: str) -> tuple[int, dict]:
        p = subprocess.run([sys.executable, "-m", "v4flash_pd", "doctor", "--json", "--config", str(cfg), *extra],
                           capture_output=True, text=True, env=env, timeout=300)
        assert "Traceback" not in p.stderr, p.stderr
        return p.returncode, {c["name"]: c for c in json.loads(p.stdout)["checks"]}

    rc, checks = run("--rehearse")
    assert rc in (EXIT_OK, EXIT_WARN), {n: c["status"] for n, c in checks.items()}
    for name in ("gpus", "gpu-numa", "model-dir"):
        assert checks[name]["status"] == "skip" and "not needed for a rehearsal" in checks[name]["detail"], checks[name]
    assert checks["ports"]["status"] == "ok"
    real_rc, real = run()
    assert real_rc == EXIT_ERROR and real["gpus"]["status"] == "error"  # the real start needs them
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[5]))
        busy.listen(1)
        busy_rc, busy_checks = run("--rehearse")
    assert busy_rc == EXIT_ERROR and busy_checks["ports"]["status"] == "error"


@pytest.mark.parametrize("gpus", [0, 4], ids=["no-gpu", "four-of-eight"])
def test_doctor_gpu_without_the_plans_gpus_says_so_and_leaves_no_temp_dir(box, gpus: int):
    """`doctor --gpu` on a machine without (all of) the plan's GPUs: one plain selfcheck row, no check
    process that would blame torch, exit 4 (errors) as documented, and nothing left in the temp dir."""
    tmpdir = box["tmp"] / "tmpdir"
    tmpdir.mkdir()
    smi = str(make_nvidia_smi(box["tmp"], count=gpus)) if gpus else str(box["tmp"] / "missing-nvidia-smi")
    rc, checks = doctor(box, "--gpu", "--only", "gpu", V4FLASH_NVIDIA_SMI=smi, TMPDIR=str(tmpdir))
    assert rc == EXIT_ERROR
    rows = {n: c for n, c in checks.items() if n.startswith("selfcheck")}
    assert list(rows) == ["selfcheck"], rows
    row = rows["selfcheck"]
    assert row["status"] == "error" and "torch" not in row["detail"], row
    if gpus:
        assert "the plan uses GPUs 0-7 but this machine has 0-3" in row["detail"], row
    else:
        assert row["detail"].startswith("no GPU on this machine"), row
    assert "--rehearse" in row["fix"] and "the self-check did not run" in row["detail"]
    assert list(tmpdir.iterdir()) == []
