"""What a plan exposes beyond its box, and what (if anything) guards each listener.

`plan` prints it and `doctor` reports it, so an operator sees before the start that, say, the KV
bootstrap port answers anyone on the cluster network. Only the router and, with an API key, the
workers' HTTP ports authenticate; SGLang's KV bootstrap server, NCCL, the Prometheus endpoint and the
KV transfer itself (NIXL/UCX, plus SGLang's ZMQ side channel on ports picked at run time) have no
authentication of their own: keep them on a private network (k8s: the rendered NetworkPolicy;
Slurm: workers bind the box's interconnect address).
"""

from __future__ import annotations

from dataclasses import dataclass

from v4flash_pd.plan import Plan
from v4flash_pd.workerauth import MODULE as WORKER_AUTH_MODULE

LOOPBACK_NAMES = ("localhost", "::1")


@dataclass(frozen=True)
class Listener:
    owner: str  # e.g. "prefill-0 bootstrap"
    where: str  # host:port, or a description for run-time ports
    guard: str  # what protects it, in words ("" = nothing)


def _loopback(host: str) -> bool:
    return host in LOOPBACK_NAMES or host.startswith("127.")


def listeners(plan: Plan) -> list[Listener]:
    """Every listener of the plan reachable from other machines, with its guard."""
    keyed_workers = any(WORKER_AUTH_MODULE in p.argv for p in plan.workers())
    out: list[Listener] = []
    for p in plan.processes:
        for u in p.ports:
            if _loopback(u.host):
                continue
            where = f"{u.host}:{u.port}"
            if u.kind == "http" and p.role == "router":
                guard = "API key" if plan.router_auth[0] else ""
            elif u.kind == "http":
                guard = "API key (the router's)" if keyed_workers else ""
            else:
                guard = ""
            out.append(Listener(u.owner, where, guard))
    if plan.mode == "pd" and plan.workers():
        out.append(Listener("KV transfer", "NIXL/UCX and SGLang's ZMQ side channel, on $SGLANG_HOST_IP or the "
                            "address SGLang detects, ports picked at run time", ""))
    return out


def lines(plan: Plan) -> list[str]:
    return [f"{x.owner} on {x.where}: {x.guard or 'NO authentication'}" for x in listeners(plan)]


def unguarded(plan: Plan) -> list[Listener]:
    """Listeners on a network address that nothing guards (the KV transfer channel is always one)."""
    return [x for x in listeners(plan) if not x.guard]


def advice(plan: Plan) -> str:
    """How to keep the unguarded listeners private, for this kind of plan."""
    if plan.scope:  # a part of a cluster
        return ("keep the cluster network private: with `render k8s` apply its NetworkPolicy (only the router and "
                "the peer workers reach worker pods); on Slurm the workers bind each box's interconnect address "
                "(cluster.bind_host = \"advertise\"); set router.api_key_file so the worker HTTP ports need the key")
    return ("keep workers, bootstrap, NCCL and metrics on 127.0.0.1 (the profile's default); on one box "
            "--set env.SGLANG_HOST_IP=127.0.0.1 keeps the KV side channel there too; put the router behind an "
            "API key (router.api_key_file)")
