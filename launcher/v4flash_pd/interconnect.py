"""Where a cluster box's workers listen: its own address on the interconnect, not every interface.

A worker's HTTP port, SGLang's KV bootstrap server (it binds the worker's --host) and the KV side
channel (SGLANG_HOST_IP) need only be reachable by the router and the other boxes. With
`cluster.bind_host = "advertise"` (the default) each box binds its workers to its own entry of
cluster.hosts, the address the others reach it by (the sbatch script fills cluster.hosts from each
node's NodeAddr, or from V4FLASH_CLUSTER_HOSTS); without hosts it falls back to 0.0.0.0, and
Kubernetes pods, each with its own network namespace, listen on 0.0.0.0 behind a NetworkPolicy.
"""

from __future__ import annotations

from typing import Callable, Sequence

from v4flash_pd.ports import WILDCARD_HOSTS, is_ip

ADVERTISE = "advertise"
ANY = "0.0.0.0"


def bind_host(bind: str, hosts: Sequence[str], box: int) -> str:
    """The --host of the workers of `box`."""
    if bind != ADVERTISE:
        return bind
    return hosts[box] if hosts else ANY


def side_channel_env(host: str) -> tuple[tuple[str, str], ...]:
    """SGLANG_HOST_IP for a worker bound to one IP: SGLang binds its ZMQ KV side channel there (and
    tells peers that address). A host name is left alone: ZMQ binds only numeric addresses."""
    if is_ip(host) and host not in WILDCARD_HOSTS:
        return (("SGLANG_HOST_IP", host),)
    return ()


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr == "::1"


def loopback_binds(local: Sequence[tuple[str, str, int | None]], advertised: Sequence[str],
                   resolve: Callable[[str], tuple[str, ...] | None]) -> list[tuple[str, str]]:
    """(problem, fix) for each local worker bound to a host *name* that is a loopback address on this
    box while the cluster has other hosts: they could never reach it (Debian maps a host's own name
    to 127.0.1.1). A loopback literal is taken as meant (logical boxes on one host, as in CI).

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
