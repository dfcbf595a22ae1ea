"""Fixture boxes for doctor tests: a fake sysfs tree, a fake `nvidia-smi`, fake `numactl`s, a model dir.

The fakes are real executables (run as subprocesses by the real code paths); only what the test
box cannot have (8 GPUs on 2 sockets, a container without CAP_SYS_NICE) is faked.
"""

from __future__ import annotations

import hashlib
import json
import stat
import struct
import sys
from pathlib import Path

# A healthy RTX PRO 6000 box: GPUs 0-3 on socket 0, 4-7 on socket 1.
BUS_IDS = ["00000000:17:00.0", "00000000:3D:00.0", "00000000:63:00.0", "00000000:89:00.0",
           "00000000:9A:00.0", "00000000:B0:00.0", "00000000:C6:00.0", "00000000:DC:00.0"]
HEALTHY_NODES = [0, 0, 0, 0, 1, 1, 1, 1]
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def make_sysfs(root: Path, gpu_nodes: list[int] = HEALTHY_NODES) -> Path:
    for n, cpus in ((0, "0-15,32-47"), (1, "16-31,48-63")):
        d = root / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")
    for bus, node in zip(BUS_IDS, gpu_nodes):
        sysbus = bus.lower()[4:]  # 00000000:17:00.0 -> 0000:17:00.0
        d = root / "bus" / "pci" / "devices" / sysbus
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


def make_nvidia_smi(d: Path, name: str = RTX, cap: str = "12.0", driver: str = "580.95.05", count: int = 8) -> Path:
    """An `nvidia-smi` that answers the --query-gpu call like the real one and logs its argv."""
    rows = [f"{i}, {name}, {BUS_IDS[i]}, {cap}, 97887, {driver}, GPU-{i:08d}" for i in range(count)]
    log = d / "nvidia-smi.log"
    return _exe(d / "nvidia-smi", f"""#!{sys.executable}
import json, sys
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if not any(a.startswith("--query-gpu=") for a in sys.argv[1:]):
    print("unsupported fake call", file=sys.stderr); sys.exit(2)
print({chr(10).join(rows)!r})
""")


def make_numactl_ok(d: Path) -> Path:
    """numactl on a 2-socket box: logs argv, then runs the command after `--` (binding is not
    possible on the 1-node test VM, so this is the part we fake)."""
    log = d / "numactl.log"
    return _exe(d / "numactl", f"""#!{sys.executable}
import json, os, sys
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
cmd = args[args.index("--") + 1:] if "--" in args else [a for a in args if not a.startswith("-")]
os.execvp(cmd[0], cmd)
""")


def make_numactl_docker(d: Path) -> Path:
    """numactl inside docker without --cap-add SYS_NICE: seccomp refuses set_mempolicy (EPERM)."""
    return _exe(d / "numactl", f"""#!{sys.executable}
import sys
if any(a.startswith(("--membind", "-m", "--preferred", "--interleave")) for a in sys.argv[1:]):
    sys.stderr.write("set_mempolicy: Operation not permitted\\nsetting membind: Operation not permitted\\n")
    sys.exit(1)
""")


def safetensors_bytes(tensors: dict[str, int]) -> bytes:
    """A valid safetensors file with uint8 tensors of the given byte sizes."""
    header, off = {}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [off, off + size]}
        off += size
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + bytes(range(256)) * (off // 256) + bytes(off % 256)


def make_model(root: Path, with_manifest: bool = True) -> Path:
    m = root / "DeepSeek-V4-Flash"
    m.mkdir(parents=True)
    (m / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}))
    (m / "tokenizer.json").write_text("{}")
    (m / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    shards = {"model-00001-of-00002.safetensors": {"a": 3000, "b": 1000},
              "model-00002-of-00002.safetensors": {"c": 5000}}
    wm = {}
    for fname, tensors in shards.items():
        (m / fname).write_bytes(safetensors_bytes(tensors))
        wm.update(dict.fromkeys(tensors, fname))
    (m / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    if with_manifest:
        from v4flash_pd.bundle.modelmanifest import ModelFile, ModelManifest

        files = tuple(ModelFile(p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
                      for p in sorted(m.iterdir()))
        (m / ".v4flash-manifest.json").write_text(ModelManifest(m.name, "2026-11-29T00:00:00Z", files).to_json())
    return m


def write_lock(path: Path, pins: dict[str, str]) -> Path:
    lines = ["# test lock"]
    for name, version in pins.items():
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{'ab' * 32}")
    path.write_text("\n".join(lines) + "\n")
    return path
