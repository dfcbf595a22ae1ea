"""Topology: which GPUs exist, their PCI bus ids, which NUMA node each sits on, each node's CPUs.

Probed once through one seam (a sysfs root + an nvidia-smi executable, both overridable from the
environment: V4FLASH_SYSFS_ROOT, V4FLASH_NVIDIA_SMI) so tests and `--topology FILE` can describe any
machine, including one that does not exist yet.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from v4flash_pd import docformat
from v4flash_pd.errors import UserError
from v4flash_pd.textfile import read_text_file

UNKNOWN_NODE = -1
_QUERY = "index,name,pci.bus_id,compute_cap,memory.total,driver_version,uuid"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    bus_id: str  # normalised sysfs form: 0000:17:00.0
    numa_node: int  # -1 = unknown
    compute_cap: str = ""
    memory_mib: int = 0
    uuid: str = ""


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: str  # kernel cpulist syntax, e.g. "0-15,32-47"


@dataclass(frozen=True)
class Topology:
    gpus: tuple[Gpu, ...]
    nodes: tuple[NumaNode, ...]
    driver_version: str = ""
    source: str = ""
    notes: tuple[str, ...] = ()

    def gpu(self, index: int) -> Gpu | None:
        return next((g for g in self.gpus if g.index == index), None)

    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.id for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return docformat.stamp(docformat.TOPOLOGY, asdict(self))


def normalize_bus_id(bus_id: str) -> str:
    """nvidia-smi prints 00000000:17:00.0, sysfs uses 0000:17:00.0; both lowercase hex."""
    bus_id = bus_id.strip().lower()
    m = re.fullmatch(r"(?:([0-9a-f]+):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])", bus_id)
    if not m:
        return bus_id
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


def parse_cpulist(text: str) -> tuple[int, ...]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return tuple(cpus)


def read_numa_nodes(sysfs_root: Path) -> tuple[NumaNode, ...]:
    base = sysfs_root / "devices" / "system" / "node"
    nodes = []
    if base.is_dir():
        for entry in sorted(base.iterdir()):
            m = re.fullmatch(r"node(\d+)", entry.name)
            if m and (entry / "cpulist").is_file():
                nodes.append(NumaNode(int(m.group(1)), (entry / "cpulist").read_text().strip()))
    return tuple(sorted(nodes, key=lambda n: n.id))


def read_gpu_numa_node(sysfs_root: Path, bus_id: str) -> int:
    path = sysfs_root / "bus" / "pci" / "devices" / bus_id / "numa_node"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return UNKNOWN_NODE


def parse_nvidia_smi(text: str) -> list[dict[str, str]]:
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 3:
            continue
        cols += [""] * (7 - len(cols))
        rows.append(dict(zip(("index", "name", "bus_id", "compute_cap", "memory", "driver", "uuid"), cols)))
    return rows


def _int(text: str, default: int = 0) -> int:
    try:
        return int(float(text))
    except (ValueError, OverflowError):  # "[N/A]", "inf"
        return default


def probe(env: Mapping[str, str] | None = None) -> Topology:
    """Probe this host. No GPUs (or no nvidia-smi) is not an error here: the plan decides."""
    import shutil
    import subprocess

    env = os.environ if env is None else env
    sysfs_root = Path(env.get("V4FLASH_SYSFS_ROOT", "/sys"))
    smi = env.get("V4FLASH_NVIDIA_SMI") or shutil.which("nvidia-smi") or ""
    notes: list[str] = []
    gpus: list[Gpu] = []
    driver = ""
    if not smi:
        notes.append("nvidia-smi not found: no GPUs detected")
    else:
        try:
            res = subprocess.run([smi, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            res = None
            notes.append(f"nvidia-smi ({smi}) could not run: {exc}")
        if res is not None and res.returncode != 0:
            notes.append(f"nvidia-smi failed (exit {res.returncode}): {res.stderr.strip()[:200]}")
        elif res is not None:
            for row in parse_nvidia_smi(res.stdout):
                bus = normalize_bus_id(row["bus_id"])
                gpus.append(Gpu(index=_int(row["index"]), name=row["name"], bus_id=bus,
                                numa_node=read_gpu_numa_node(sysfs_root, bus), compute_cap=row["compute_cap"],
                                memory_mib=max(0, _int(row["memory"])), uuid=row["uuid"]))
                driver = driver or row["driver"]
    return Topology(gpus=tuple(sorted(gpus, key=lambda g: g.index)), nodes=read_numa_nodes(sysfs_root),
                    driver_version=driver, source=f"probe(sysfs={sysfs_root}, nvidia-smi={smi or 'none'})",
                    notes=tuple(notes))


_TOPO_FIX = "regenerate it with `v4flash-pd topology --save FILE` on the target box, or follow its format"


def _bad(source: str, what: str) -> UserError:
    return UserError(f"topology {source or 'data'} is malformed: {what}", _TOPO_FIX)


def _int_field(value: Any, where: str, source: str, *, allow_none: bool = False, low: int | None = None,
               meaning: str = "") -> int:
    """An integer field (at least `low`, where given); `null` (numa_node only) means what sysfs writes
    as -1: not known."""
    if value is None and allow_none:
        return UNKNOWN_NODE
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(source, f"{where} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise _bad(source, f"{where} must be >= {low}{meaning}, got {value}")
    return value


def _str_field(value: Any, where: str, source: str) -> str:
    if not isinstance(value, str):
        raise _bad(source, f"{where} must be a string, got {value!r}")
    return value


def from_dict(data: Any, source: str = "") -> Topology:
    if not isinstance(data, dict):
        raise _bad(source, f"the top level must be a JSON object with \"gpus\" and \"nodes\", got {type(data).__name__}")
    raw_gpus, raw_nodes = data.get("gpus", []), data.get("nodes", [])
    if not isinstance(raw_gpus, list) or not isinstance(raw_nodes, list):
        raise _bad(source, "\"gpus\" and \"nodes\" must be lists")
    gpus = []
    for i, g in enumerate(raw_gpus):
        if not isinstance(g, dict) or "index" not in g:
            raise _bad(source, f"gpus[{i}] must be an object with at least an \"index\"")
        gpus.append(Gpu(index=_int_field(g["index"], f"gpus[{i}].index", source),
                        name=_str_field(g.get("name", ""), f"gpus[{i}].name", source),
                        bus_id=normalize_bus_id(_str_field(g.get("bus_id", ""), f"gpus[{i}].bus_id", source)),
                        numa_node=_int_field(g.get("numa_node"), f"gpus[{i}].numa_node", source, allow_none=True),
                        compute_cap=_str_field(g.get("compute_cap", ""), f"gpus[{i}].compute_cap", source),
                        memory_mib=_int_field(g.get("memory_mib", 0), f"gpus[{i}].memory_mib", source, low=0,
                                              meaning=" (MiB; 0 = not known)"),
                        uuid=_str_field(g.get("uuid", ""), f"gpus[{i}].uuid", source)))
    if len({g.index for g in gpus}) != len(gpus):
        raise _bad(source, "a GPU index appears twice")
    nodes = []
    for i, n in enumerate(raw_nodes):
        if not isinstance(n, dict) or "id" not in n:
            raise _bad(source, f"nodes[{i}] must be an object with an \"id\"")
        nodes.append(NumaNode(_int_field(n["id"], f"nodes[{i}].id", source),
                              _str_field(n.get("cpus", ""), f"nodes[{i}].cpus", source)))
    notes = data.get("notes", [])
    if not isinstance(notes, list):
        raise _bad(source, "\"notes\" must be a list of strings")
    return Topology(gpus=tuple(sorted(gpus, key=lambda g: g.index)), nodes=tuple(nodes),
                    driver_version=_str_field(data.get("driver_version", ""), "driver_version", source),
                    source=source or str(data.get("source", "")), notes=tuple(str(n) for n in notes))


def load(path: Path | str) -> Topology:
    path = Path(path)
    text = read_text_file(path, "topology file", "create one with `v4flash-pd topology --save FILE` on the target box")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"topology file {path} is not valid JSON: {exc}",
                        "regenerate it with `v4flash-pd topology --save FILE`") from None
    return from_dict(data, source=f"file:{path}")


def save(topology: Topology, path: Path | str) -> None:
    Path(path).write_text(json.dumps(topology.to_dict(), indent=2) + "\n")


def parse_matrix(text: str) -> dict[str, Any]:
    """An `nvidia-smi topo -m` / `-p2p X` matrix: {"columns": [...], "rows": {"GPU0": [...]}} (GPU rows only)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s*GPU0\b", ln.strip()) and "\t" in ln), None)
    if header is None:
        return {"columns": [], "rows": {}}
    columns = [c.strip() for c in header.split("\t") if c.strip()]
    rows = {}
    for ln in lines:
        cells = [c.strip() for c in ln.split("\t")]
        cells = [c for c in cells if c != ""]
        if cells and re.fullmatch(r"GPU\d+", cells[0]) and ln is not header:
            rows[cells[0]] = cells[1:]
    return {"columns": columns, "rows": rows}
