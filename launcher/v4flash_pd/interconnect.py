"""Can the other boxes reach this box's workers at the address they bind?

`config/layout.py` binds each cluster box's workers to its own cluster.hosts entry
(`cluster.bind_host = "advertise"`). A host *name* that resolves to a loopback address on the box
itself (Debian maps a host's own name to 127.0.1.1) would then listen where no other box can
connect: `build_plan` refuses that before anything starts.
"""

from __future__ import annotations

from typing import Callable, Sequence

from v4flash_pd.ports import WILDCARD_HOSTS, is_ip


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr == "::1"


def loopback_binds(local: Sequence[tuple[str, str, int | None]], advertised: Sequence[str],
                   resolve: Callable[[str], tuple[str, ...] | None]) -> list[tuple[str, str]]:
    """(problem, fix) for each local worker bound to a host *name* that is a loopback address on this
    box while the cluster has other hosts: they could never reach it. A loopback literal is taken as
    meant (logical boxes on one host, as in CI).

    `local` = (worker name, bound host, box) of the workers this box starts; `advertised` = every
    box's host as the others reach it."""
    out = []
    for name, host, box in local:
        if box is None or host in WILDCARD_HOSTS or is_ip(host) or host == "localhost":
            continue
        if not any(a != host for a in advertised):
            continue  # every box is this host: nothing else has to reach it
        addrs = resolve(host) or ()
        if addrs and all(_loopback(a) for a in addrs):
            out.append((f"{name} would listen on {host} = {', '.join(addrs)} on this box, a loopback address the "
                        "other boxes cannot reach (a host's own name often maps to 127.0.1.1 in /etc/hosts)",
                        "give the boxes by their interconnect IPs (V4FLASH_CLUSTER_HOSTS=10.0.0.1,10.0.0.2 or "
                        "--hosts), fix /etc/hosts, or --set cluster.bind_host=0.0.0.0 to listen on every interface"))
    return out
