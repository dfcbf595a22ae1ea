"""NUMA: the one builder of numactl command prefixes, and the probe that runs it on this host.

Docker's seccomp profile refuses set_mempolicy/mbind without CAP_SYS_NICE, which makes
`numactl --membind` kill a worker silently, so every node the plan binds to is probed up front
with exactly the prefix the plan will use (`numactl_prefix`), and the plan falls back to
--preferred (or CPU-only binding) loudly. V4FLASH_NUMACTL names the numactl binary (tests point it
at a fake that behaves like a container without CAP_SYS_NICE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from v4flash_pd.topology import parse_cpulist

# membind: memory on the node; preferred: memory there when it can; cpu: --cpunodebind only; none: unbound
Policy = Literal["membind", "preferred", "cpu", "none"]


@dataclass(frozen=True)
class Binding:
    node: int | None
    policy: Policy
    reason: str = ""


@dataclass(frozen=True)
class NodeProbe:
    """What this host permits on one NUMA node, found by running the plan's own prefixes."""

    node: int
    membind_ok: bool
    preferred_ok: bool
    cpu_ok: bool = True  # False: the node is absent here or outside this container's cpuset
    detail: str = ""


def numactl_prefix(binding: Binding, numactl: str) -> tuple[str, ...]:
    """The argv prefix that binds a process (empty when not bound). The only place it is built."""
    if binding.policy == "none" or binding.node is None:
        return ()
    exe = numactl or "numactl"
    if binding.policy == "cpu":
        return (exe, f"--cpunodebind={binding.node}", "--")
    mem = f"--membind={binding.node}" if binding.policy == "membind" else f"--preferred={binding.node}"
    return (exe, f"--cpunodebind={binding.node}", mem, "--")


def allowed_mem_nodes(status_path: Path = Path("/proc/self/status")) -> tuple[int, ...]:
    try:
        for line in status_path.read_text().splitlines():
            if line.startswith("Mems_allowed_list:"):
                return parse_cpulist(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return (0,)


def _try(argv: tuple[str, ...]) -> tuple[bool, str]:
    import subprocess

    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"numactl could not run: {exc}"
    if res.returncode == 0:
        return True, ""
    why = (res.stderr or res.stdout).strip().splitlines()
    return False, why[0] if why else f"exit {res.returncode}"


def probe_node(numactl: str, node: int) -> NodeProbe:
    """Run `<prefix> true` for membind, then (if refused) preferred, then CPU-only: exactly the
    prefixes a worker can get. A node that even --cpunodebind refuses is not usable here."""
    ok, why = _try(numactl_prefix(Binding(node, "membind"), numactl) + ("true",))
    if ok:
        return NodeProbe(node, True, True, True, "membind permitted")
    detail = f"membind refused: {why}"
    pref_ok, _ = _try(numactl_prefix(Binding(node, "preferred"), numactl) + ("true",))
    if pref_ok:
        return NodeProbe(node, False, True, True, detail)
    detail += "; --preferred refused too"
    cpu_ok, why_cpu = _try(numactl_prefix(Binding(node, "cpu"), numactl) + ("true",))
    if not cpu_ok:
        detail = f"numactl cannot bind node {node} here: {why_cpu}"
    return NodeProbe(node, False, False, cpu_ok, detail)
