"""Facts about the host that decide how a plan can run here: numactl and membind permission.

Kept apart from the pure plan: these run commands. Docker's seccomp profile refuses
set_mempolicy/mbind without CAP_SYS_NICE, which makes `numactl --membind` kill a worker silently
(sglang#27368), so we probe once, up front, and the plan falls back to --preferred loudly.
V4FLASH_NUMACTL names the numactl binary (tests point it at a fake that behaves like a container
without CAP_SYS_NICE).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from v4flash_pd.topology import parse_cpulist


@dataclass(frozen=True)
class HostNuma:
    numactl: str  # absolute path, or "" when not installed
    allowed_nodes: tuple[int, ...]  # Mems_allowed of this process
    membind_ok: bool
    detail: str = ""
    # --preferred needs set_mempolicy too, which docker's seccomp refuses along with --membind;
    # when both are refused only CPU binding (sched_setaffinity) is left.
    preferred_ok: bool = False


def allowed_mem_nodes(status_path: Path = Path("/proc/self/status")) -> tuple[int, ...]:
    try:
        for line in status_path.read_text().splitlines():
            if line.startswith("Mems_allowed_list:"):
                return parse_cpulist(line.split(":", 1)[1])
    except OSError:
        pass
    return (0,)


def probe_numa(env: Mapping[str, str] | None = None) -> HostNuma:
    env = os.environ if env is None else env
    numactl = env.get("V4FLASH_NUMACTL") or shutil.which("numactl") or ""
    nodes = allowed_mem_nodes()
    if not numactl:
        return HostNuma("", nodes, False, "numactl is not installed")
    node = nodes[0] if nodes else 0
    try:
        res = subprocess.run([numactl, f"--cpunodebind={node}", f"--membind={node}", "--", "true"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return HostNuma(numactl, nodes, False, f"numactl could not run: {exc}")
    if res.returncode == 0:
        return HostNuma(numactl, nodes, True, "membind permitted", preferred_ok=True)
    why = (res.stderr or res.stdout).strip().splitlines()
    detail = f"membind refused: {why[0] if why else 'exit ' + str(res.returncode)}"
    try:
        pref = subprocess.run([numactl, f"--cpunodebind={node}", f"--preferred={node}", "--", "true"],
                              capture_output=True, text=True, timeout=20)
        preferred_ok = pref.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        preferred_ok = False
    if not preferred_ok:
        detail += "; --preferred refused too"
    return HostNuma(numactl, nodes, False, detail, preferred_ok=preferred_ok)
