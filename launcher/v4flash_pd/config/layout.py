"""Cluster layout: N boxes x NUMA slots, each slot one TP worker, from a built Config's templates.

The box is the unit of placement: TP never spans PCIe boxes, so a worker is a slot (the GPUs of
one NUMA node) of one box. `expand` turns a Config with a [cluster] table into the cluster's
Config (its workers are the slots, named prefill-i / decode-j across the whole cluster, built from
[[prefill]]/[[decode]] entry 0); which part one box starts is plan-level work (`cluster.select`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from v4flash_pd.config.types import ClusterSpec, Config, WorkerSpec
from v4flash_pd.config.values import port
from v4flash_pd.errors import UserError
from v4flash_pd.ports import WILDCARD_HOSTS, is_ip

# Where a cluster box's workers listen: its own address on the interconnect, not every interface. A
# worker's HTTP port, SGLang's KV bootstrap server (it binds the worker's --host) and the KV side
# channel (SGLANG_HOST_IP) need only be reachable by the router and the other boxes. With
# `cluster.bind_host = "advertise"` (the default) each box binds its workers to its own entry of
# cluster.hosts, the address the others reach it by (the sbatch script fills cluster.hosts from each
# node's NodeAddr, or from V4FLASH_CLUSTER_HOSTS); without hosts it falls back to 0.0.0.0, and
# Kubernetes pods, each with its own network namespace, listen on 0.0.0.0 behind a NetworkPolicy.
ADVERTISE = "advertise"
ANY = "0.0.0.0"


@dataclass(frozen=True)
class Slot:
    box: int
    slot: int  # NUMA slot within the box (index into cluster.slot_gpus)
    role: str
    index: int  # position in its role across the cluster

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def layout(spec: ClusterSpec) -> tuple[Slot, ...]:
    """Slot-major placement, prefill first: the first slot of every box, then the second...

    1P1D on two boxes puts prefill on one and decode on the other; 2P2D puts one of each on every
    box (prefill on NUMA slot 0, decode on slot 1, like the one-box profile).
    """
    per_box = len(spec.slot_gpus)
    capacity = spec.boxes * per_box
    want = spec.prefill + spec.decode
    if want > capacity:
        raise UserError(
            f"cluster asks for {spec.prefill} prefill + {spec.decode} decode workers = {want} slots, but "
            f"{spec.boxes} box(es) x {per_box} NUMA slots hold {capacity}",
            f"use --boxes {-(-want // per_box)} (each box holds {per_box} TP workers), or fewer workers",
        )
    order = [(b, s) for s in range(per_box) for b in range(spec.boxes)]
    roles = [("prefill", i) for i in range(spec.prefill)] + [("decode", i) for i in range(spec.decode)]
    slots = tuple(Slot(b, s, role, i) for (b, s), (role, i) in zip(order, roles))
    empty = sorted(set(range(spec.boxes)) - {s.box for s in slots})
    if empty:
        raise UserError(
            f"box(es) {', '.join(map(str, empty))} of the {spec.boxes}-box cluster would run nothing ({want} workers "
            f"fill {len({s.box for s in slots})} box(es))",
            f"use --boxes {spec.boxes - len(empty)}, or add workers (--prefill/--decode)",
        )
    return slots


def slot_ports(spec: ClusterSpec, slot: Slot) -> dict[str, int]:
    """Slot s of box k: the base ports + s, + k x port_offset (0 on a real cluster: boxes do not
    share a network namespace; logical nodes on one host, as in CI, need an offset)."""
    shift = slot.slot + slot.box * spec.port_offset
    ports = {"port": spec.http_port + shift, "nccl_port": spec.nccl_port + shift}
    if slot.role == "prefill":
        ports["bootstrap_port"] = spec.bootstrap_port + shift
    return {key: port(value, f"{slot.role}.{slot.index}.{key}") for key, value in ports.items()}


def _check_ports(cfg: Config, spec: ClusterSpec, workers: list[WorkerSpec]) -> None:
    """Ports of one box (router on box 0 included) must differ; with an offset, all of them do."""
    groups: dict[int, list[tuple[str, int]]] = {}
    for w in workers:
        key = 0 if spec.port_offset else w.box or 0
        groups.setdefault(key, []).extend((u.owner, u.port) for u in w.port_uses())
    if cfg.router is not None:
        groups.setdefault(0, []).extend((u.owner, u.port) for u in cfg.router.port_uses())
    for box, used in sorted(groups.items()):
        seen: dict[int, str] = {}
        for owner, number in used:
            if number in seen:
                where = "the cluster (port_offset > 0: one network namespace)" if spec.port_offset else f"box {box}"
                raise UserError(
                    f"port {number} is used twice on {where}: by {seen[number]} and by {owner}",
                    "slot s of box k listens on cluster.http_port/bootstrap_port/nccl_port + s + k x "
                    "cluster.port_offset: use an offset larger than the spread of all boxes' ports (e.g. --port-offset "
                    "100 with the default bases), move the bases apart (e.g. --set cluster.nccl_port=31000), or move "
                    "the router (--set router.port=N)",
                )
            seen[number] = owner


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


def _with_network(env: tuple[tuple[str, str], ...], network: str) -> tuple[tuple[str, str], ...]:
    """KV goes between boxes: UCX_TLS must carry a network transport (cuda_ipc and sm stay inside a host)."""
    out = []
    for k, v in env:
        if k == "UCX_TLS" and v.strip() not in ("", "all"):
            tls = [t.strip() for t in v.split(",") if t.strip()]
            if network not in tls:
                tls.append(network)
            v = ",".join(tls)
        out.append((k, v))
    return tuple(out)


def expand(cfg: Config) -> Config:
    """The cluster Config: one worker per slot, from the [[prefill]]/[[decode]] entry 0 templates
    (a Config without a [cluster] table is returned as it is)."""
    spec = cfg.cluster
    if spec is None:
        return cfg
    for role in ("prefill", "decode"):
        if len(cfg.role(role)) > 1:
            raise UserError(
                f"the config lists {len(cfg.role(role))} [[{role}]] workers and a cluster plan (cluster.boxes = "
                f"{spec.boxes}): in a cluster, [[{role}]] entry 0 is the template of every {role} slot",
                f"set the number of {role} workers with --{role} N (cluster.{role}) and keep one [[{role}]] entry",
            )
    if spec.hosts and len(spec.hosts) != spec.boxes:
        raise UserError(f"cluster.hosts names {len(spec.hosts)} host(s) for {spec.boxes} box(es)",
                        "give one host per box, in box order (e.g. --hosts node1,node2), or none at all")
    workers: list[WorkerSpec] = []
    for slot in layout(spec):
        template = cfg.role(slot.role)[0]
        gpus = spec.slot_gpus[slot.slot]
        if len(gpus) % template.tp:
            raise UserError(
                f"cluster.slot_gpus[{slot.slot}] has {len(gpus)} GPU(s), which a {slot.role} worker of TP "
                f"{template.tp} cannot use (a worker is one slot: the GPUs of one NUMA node)",
                f"give every slot a multiple of {template.tp} GPUs (--set cluster.slot_gpus=[[0,1,2,3],[4,5,6,7]]), "
                f"or --set {slot.role}.0.tp=N with N a divisor of {len(gpus)}")
        ports = slot_ports(spec, slot)
        host = bind_host(spec.bind_host, spec.hosts, slot.box)
        workers.append(replace(
            template, name=slot.name, index=slot.index, gpus=gpus, numa_node=None, host=host,
            port=ports["port"], nccl_port=ports["nccl_port"], bootstrap_port=ports.get("bootstrap_port"),
            box=slot.box, advertise=spec.hosts[slot.box] if spec.hosts else "",
            env=_with_network(template.env, spec.network) + side_channel_env(host)))  # a worker's own UCX_TLS too
    _check_ports(cfg, spec, workers)
    return replace(cfg, workers=tuple(workers), env=_with_network(cfg.env, spec.network))
