"""The box's facts: fingerprint and stack versions, GPUs and driver, PCIe topology with the P2P
matrices, the NUMA map. Raw tool output is kept next to what is parsed from it (a tool that is
missing or fails is recorded as such, never fatal)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from v4flash_pd.fingerprint import fingerprint
from v4flash_pd.topology import Topology, parse_matrix


def tools(env: Mapping[str, str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(file, argv) of every command whose output goes into the report (the probes' own seams apply)."""
    smi = env.get("V4FLASH_NVIDIA_SMI") or "nvidia-smi"
    numactl = env.get("V4FLASH_NUMACTL") or "numactl"
    return (
        ("nvidia-smi-q.txt", (smi, "-q")),
        ("nvidia-smi-topo-m.txt", (smi, "topo", "-m")),
        ("nvidia-smi-topo-p2p-r.txt", (smi, "topo", "-p2p", "r")),
        ("nvidia-smi-topo-p2p-w.txt", (smi, "topo", "-p2p", "w")),
        ("numactl-H.txt", (numactl, "-H")),
        ("lscpu.txt", ("lscpu",)),
        ("uname.txt", ("uname", "-a")),
    )


def run_tool(argv: Sequence[str], env: Mapping[str, str], timeout: float = 60.0) -> tuple[bool, str]:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=dict(env))
    except FileNotFoundError:
        return False, f"not available: {argv[0]} is not installed here\n"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"not available: {' '.join(argv)}: {exc}\n"
    if p.returncode != 0:
        return False, f"not available: {' '.join(argv)} exited {p.returncode}: {(p.stderr or p.stdout).strip()[:500]}\n"
    return True, p.stdout


def p2p_summary(matrix: dict[str, Any]) -> str:
    """'all 56 GPU pairs OK' / '32 of 56 GPU pairs not OK (NS)' / 'unknown'."""
    gpus = [c for c in matrix.get("columns", []) if re.fullmatch(r"GPU\d+", c)]
    if not gpus or not matrix.get("rows"):
        return "unknown"
    total, bad, kinds = 0, 0, set()
    for i, a in enumerate(gpus):
        row = matrix["rows"].get(a) or []
        for j, _ in enumerate(gpus):
            if i == j or j >= len(row):
                continue
            total += 1
            if row[j] != "OK":
                bad += 1
                kinds.add(row[j])
    if not bad:
        return f"all {total} GPU pairs OK"
    return f"{bad} of {total} GPU pairs not OK ({', '.join(sorted(kinds))})"


def numa_map(topology: Topology) -> dict[str, Any]:
    return {"gpus": {str(g.index): g.numa_node for g in topology.gpus},
            "nodes": {str(n.id): n.cpus for n in topology.nodes}}


def collect(out: Path, topology: Topology, env: Mapping[str, str]) -> dict[str, Any]:
    """Write `out/fingerprint/*` and return the parsed facts."""
    d = out / "fingerprint"
    d.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(topology)
    (d / "fingerprint.json").write_text(json.dumps(fp, indent=2) + "\n")
    (d / "topology.json").write_text(json.dumps(topology.to_dict(), indent=2) + "\n")
    outputs: dict[str, dict[str, Any]] = {}
    texts: dict[str, str] = {}
    for name, argv in tools(env):
        ok, text = run_tool(argv, env)
        (d / name).write_text(text)
        outputs[name] = {"ok": ok, "argv": list(argv)}
        texts[name] = text if ok else ""
    p2p_r = parse_matrix(texts["nvidia-smi-topo-p2p-r.txt"])
    p2p_w = parse_matrix(texts["nvidia-smi-topo-p2p-w.txt"])
    topo_m = parse_matrix(texts["nvidia-smi-topo-m.txt"])
    facts = {
        "fingerprint": fp, "gpus": [g.__dict__ for g in topology.gpus], "driver": topology.driver_version,
        "topology_source": topology.source,
        "numa": numa_map(topology), "topology_matrix": topo_m, "p2p_read": p2p_r, "p2p_write": p2p_w,
        "p2p_read_summary": p2p_summary(p2p_r), "p2p_write_summary": p2p_summary(p2p_w), "tools": outputs,
    }
    (d / "facts.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")
    return facts
