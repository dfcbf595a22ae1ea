"""What ran: versions of the pinned stack, GPUs and driver, recorded next to the resolved config so
a run can be reproduced and two runs compared (srt-slurm fingerprint.py)."""

from __future__ import annotations

import importlib.metadata as md
import platform
import socket
import sys
from typing import Any

from v4flash_pd import __version__
from v4flash_pd.topology import Topology

STACK_PACKAGES = ("sglang", "sglang-kernel", "flashinfer-python", "flashinfer-cubin", "torch", "triton",
                  "tilelang", "nixl-cu13", "sglang-router", "transformers", "v4flash-pd")


def package_versions(names: tuple[str, ...] = STACK_PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def fingerprint(topology: Topology) -> dict[str, Any]:
    return {
        "v4flash_pd": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "packages": package_versions(),
        "gpus": [f"{g.index}:{g.name}:{g.bus_id}:numa{g.numa_node}" for g in topology.gpus],
        "driver": topology.driver_version,
    }
