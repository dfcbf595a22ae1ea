"""Fake GPU boxes for tests: a sysfs tree, a logging `nvidia-smi`, a `numactl` shim, topology JSON.

Plain functions (no pytest import) so any test area (launcher, doctor) can build the same machine.
The launcher reads these through its real seams, from outside the process:
`V4FLASH_SYSFS_ROOT`, `V4FLASH_NVIDIA_SMI`, `V4FLASH_NUMACTL` (see `box_env`). The scripts are real
executables run as real subprocesses; only the hardware they describe is made up.

Formats follow what the real tools print (ci-recipes §3): nvidia-smi shows bus ids with an 8-digit
PCI domain (`00000000:17:00.0`, upper-case hex), sysfs uses 4 digits (`0000:17:00.0`), and
`/sys/bus/pci/devices/<bdf>/numa_node` may be missing or `-1` (unknown).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

T = TypeVar("T")

DRIVER = "580.95.05"
GPU_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
CC = "12.0"
MEMORY_MIB = 97887

# (sysfs bus id, NUMA node); node None = sysfs has no numa_node file for that device.
GpuSpec = tuple[str, "int | None"]

# The reference box: 8 GPUs, 4 per socket (bus ids as on a dual-socket SYS-522GA style board).
BUS_IDS_8 = ("0000:17:00.0", "0000:3d:00.0", "0000:63:00.0", "0000:89:00.0",
             "0000:9a:00.0", "0000:ab:00.0", "0000:c1:00.0", "0000:e1:00.0")
NODES_2 = {0: "0-15,32-47", 1: "16-31,48-63"}
NODES_1 = {0: "0-31"}


@dataclass(frozen=True)
class Box:
    """A machine description that every builder below can render."""

    name: str
    gpus: tuple[GpuSpec, ...]
    nodes: Mapping[int, str] = field(default_factory=dict)


BOX_8GPU_2NODE = Box("8gpu-2node", tuple((b, 0 if i < 4 else 1) for i, b in enumerate(BUS_IDS_8)), NODES_2)
BOX_4GPU_1NODE = Box("4gpu-1node", tuple((b, 0) for b in BUS_IDS_8[:4]), NODES_1)
# GPUs 0-3 on node 1 and 4-7 on node 0: contradicts the profile's prefill->0 / decode->1 binding.
BOX_8GPU_SWAPPED = Box("8gpu-swapped", tuple((b, 1 if i < 4 else 0) for i, b in enumerate(BUS_IDS_8)), NODES_2)
BOXES = {b.name: b for b in (BOX_8GPU_2NODE, BOX_4GPU_1NODE, BOX_8GPU_SWAPPED)}


def smi_bus_id(bus_id: str) -> str:
    """sysfs `0000:17:00.0` -> nvidia-smi `00000000:17:00.0` (8-digit domain, upper-case hex)."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def _write_exec(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def make_sysfs(tmp: Path, gpus: Sequence[GpuSpec], nodes: Mapping[int, str]) -> Path:
    """A sysfs root: devices/system/node/nodeN/cpulist and bus/pci/devices/<bdf>/numa_node."""
    root = Path(tmp) / "sysfs"
    for node, cpus in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")
    # entries the kernel also has there, which a probe must ignore
    other = root / "devices" / "system" / "node"
    other.mkdir(parents=True, exist_ok=True)
    (other / "possible").write_text(",".join(str(n) for n in nodes) + "\n")
    for bus_id, node in gpus:
        d = root / "bus" / "pci" / "devices" / bus_id
        d.mkdir(parents=True, exist_ok=True)
        (d / "vendor").write_text("0x10de\n")
        if node is not None:
            (d / "numa_node").write_text(f"{node}\n")
    return root


def nvidia_smi_rows(gpus: Sequence[GpuSpec], driver: str = DRIVER, name: str = GPU_NAME,
                    cc: str = CC) -> list[str]:
    """The lines `nvidia-smi --query-gpu=index,name,pci.bus_id,compute_cap,memory.total,
    driver_version,uuid --format=csv,noheader,nounits` prints (`, ` separated, like the real one)."""
    rows = []
    for i, (bus_id, _node) in enumerate(gpus):
        uuid = f"GPU-{i:08x}-1111-2222-3333-{i:012x}"
        rows.append(", ".join([str(i), name, smi_bus_id(bus_id), cc, str(MEMORY_MIB), driver, uuid]))
    return rows


def make_nvidia_smi(tmp: Path, gpus: Sequence[GpuSpec], driver: str = DRIVER, name: str = GPU_NAME,
                    cc: str = CC) -> Path:
    """An executable `nvidia-smi` that logs its argv (JSON lines, `<script>.log`) and prints the rows.

    Any query other than the launcher's exact one exits 2 with a message, so a changed query in
    the probe shows up as a failing test instead of silently parsing the wrong columns.
    """
    d = Path(tmp) / "bin"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "nvidia-smi"
    log = d / "nvidia-smi.log"
    out = "".join(r + "\n" for r in nvidia_smi_rows(gpus, driver, name, cc))
    script = f"""#!{sys.executable}
import json, sys
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
want = ["--query-gpu=index,name,pci.bus_id,compute_cap,memory.total,driver_version,uuid",
        "--format=csv,noheader,nounits"]
if sys.argv[1:] != want:
    sys.stderr.write("fake nvidia-smi: unsupported arguments %r\\n" % (sys.argv[1:],))
    sys.exit(2)
sys.stdout.write({out!r})
"""
    return _write_exec(path, script)


def make_numactl_shim(tmp: Path, membind_ok: bool = True, preferred_ok: bool = True) -> Path:
    """A `numactl` that logs argv as JSON lines (`<script>.log`) and execs the command after `--`.

    membind_ok=False refuses `--membind` the way docker's default seccomp profile does without
    CAP_SYS_NICE: "set_mempolicy: Operation not permitted", exit 1. Docker's profile refuses every
    memory-policy call (set_mempolicy, mbind, get_mempolicy), so `--preferred` fails there too:
    model a real container with membind_ok=False, preferred_ok=False. `--cpunodebind` (plain
    sched_setaffinity) always works, as it does in such a container.
    """
    d = Path(tmp) / "bin"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "numactl"
    log = d / "numactl.log"
    refused = ([] if membind_ok else ["--membind", "-m"]) + ([] if preferred_ok else ["--preferred"])
    script = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
opts = args[:args.index("--")] if "--" in args else args
refused = tuple({refused!r})
if refused and any(a.startswith(refused) for a in opts):
    sys.stderr.write("set_mempolicy: Operation not permitted\\n")
    sys.exit(1)
if "--" not in args or args.index("--") == len(args) - 1:
    sys.stderr.write("fake numactl: usage: numactl [options] -- command\\n")
    sys.exit(1)
cmd = args[args.index("--") + 1:]
os.execvp(cmd[0], cmd)
"""
    return _write_exec(path, script)


def read_argv_log(script: Path) -> list[list[str]]:
    """The argv lists a fake tool was called with, oldest first."""
    log = Path(str(script) + ".log")
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def topology_dict(box: Box, driver: str = DRIVER, name: str = GPU_NAME, cc: str = CC) -> dict:
    """The `--topology FILE` form of a box (same shape `v4flash-pd topology --save` writes)."""
    gpus = []
    for i, (bus_id, node) in enumerate(box.gpus):
        gpus.append({"index": i, "name": name, "bus_id": bus_id, "numa_node": -1 if node is None else node,
                     "compute_cap": cc, "memory_mib": MEMORY_MIB,
                     "uuid": f"GPU-{i:08x}-1111-2222-3333-{i:012x}"})
    return {"format": "v4flash-pd/topology/1", "gpus": gpus,
            "nodes": [{"id": n, "cpus": c} for n, c in sorted(box.nodes.items())],
            "driver_version": driver, "source": f"fakebox:{box.name}", "notes": []}


def write_topology(tmp: Path, box: Box) -> Path:
    path = Path(tmp) / f"topology-{box.name}.json"
    path.write_text(json.dumps(topology_dict(box), indent=2) + "\n")
    return path


def box_env(tmp: Path, box: Box, membind_ok: bool | None = None,
            base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment in which the launcher probes `box`: fake sysfs + fake nvidia-smi (+ numactl shim
    when membind_ok is not None). Starts from `base` (default os.environ) minus every V4FLASH_* key."""
    env = clean_env(base)
    env["V4FLASH_SYSFS_ROOT"] = str(make_sysfs(tmp, box.gpus, box.nodes))
    env["V4FLASH_NVIDIA_SMI"] = str(make_nvidia_smi(tmp, box.gpus))
    if membind_ok is not None:
        env["V4FLASH_NUMACTL"] = str(make_numactl_shim(tmp, membind_ok))
    return env


def clean_env(base: Mapping[str, str] | None = None, keep: Iterable[str] = ()) -> dict[str, str]:
    """The environment minus V4FLASH_* (a developer's shell must not change test results)."""
    base = os.environ if base is None else base
    keep = set(keep)
    return {k: v for k, v in base.items() if not k.startswith("V4FLASH_") or k in keep}


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free right now (all bound at once, so none repeats)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_pd_config(tmp: Path, ports: Sequence[int], name: str = "v4flash.toml", decodes: int = 1) -> Path:
    """A PD config on the default profile with every port moved to `ports` (3 + 2 x decodes + 2 of them:
    prefill http/bootstrap/nccl, each decode's http/nccl, router http/metrics), router on 127.0.0.1."""
    p = list(ports)
    if len(p) != 5 + 2 * decodes:
        raise ValueError(f"{decodes} decode worker(s) need {5 + 2 * decodes} ports, got {len(p)}")
    decode = "".join(f"""
[[decode]]
port = {p[3 + 2 * i]}
nccl_port = {p[4 + 2 * i]}
""" for i in range(decodes))
    path = Path(tmp) / name
    path.write_text(f"""
[[prefill]]
port = {p[0]}
bootstrap_port = {p[1]}
nccl_port = {p[2]}
{decode}
[router]
host = "127.0.0.1"
port = {p[-2]}
metrics_port = {p[-1]}
""")
    return path


def json_records(text: str) -> list[dict]:
    """The JSON-object lines of a role log (the stand-in engine logs one per request/event)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def group_alive(pgid: int) -> bool:
    """Whether anything of process group `pgid` is left (a group we may not signal counts as alive)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """`cond()`'s first truthy value, polled every `interval` s; an AssertionError naming `what` after
    `timeout` s (every wait in a test is bounded)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")

