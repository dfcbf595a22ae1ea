"""Cluster plans: N boxes x NUMA slots, each slot one TP worker, one router; and the selection of
what one box (or one pod, or the router) starts.

The box is the unit of placement: TP never spans PCIe boxes, so a worker is a slot (the GPUs of one
NUMA node) of one box. A cluster plan is still a `Config` (its workers are the slots, named
prefill-i / decode-j across the whole cluster) and still goes through the one `build_plan`: a box
plans its own slots and treats the others as remote, the router plans only itself and waits for
all of them. Nothing here assembles a command line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from v4flash_pd.config import (
    ClusterSpec,
    Config,
    WorkerSpec,
    _worker,
    read_text_file,
)
from v4flash_pd.errors import UserError
from v4flash_pd.interconnect import ADVERTISE, bind_host, side_channel_env
from v4flash_pd.profiles import PROFILES
from v4flash_pd.topology import Gpu, NumaNode, Topology

if TYPE_CHECKING:
    from v4flash_pd.plan import Plan

PLAN_FORMAT = "v4flash-pd/cluster-plan/1"
CLUSTER_ROLES = ("router", "prefill", "decode")


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
    return ports


def _check_ports(cfg: Config, spec: ClusterSpec, workers: list[WorkerSpec]) -> None:
    """Ports of one box (router on box 0 included) must differ; with an offset, all of them do."""
    groups: dict[int, list[tuple[str, int]]] = {}
    for w in workers:
        key = 0 if spec.port_offset else w.box or 0
        used = [(f"{w.name} http", w.port), (f"{w.name} nccl", w.nccl_port)]
        if w.bootstrap_port is not None:
            used.append((f"{w.name} bootstrap", w.bootstrap_port))
        groups.setdefault(key, []).extend(used)
    if cfg.router is not None:
        groups.setdefault(0, []).extend([("router http", cfg.router.port), ("router metrics", cfg.router.metrics_port)])
    for box, used in sorted(groups.items()):
        seen: dict[int, str] = {}
        for owner, port in used:
            if port in seen:
                where = "the cluster (port_offset > 0: one network namespace)" if spec.port_offset else f"box {box}"
                raise UserError(
                    f"port {port} is used twice on {where}: by {seen[port]} and by {owner}",
                    "slot s of box k listens on cluster.http_port/bootstrap_port/nccl_port + s + k x "
                    "cluster.port_offset: use an offset larger than the spread of all boxes' ports (e.g. --port-offset "
                    "100 with the default bases), move the bases apart (e.g. --set cluster.nccl_port=31000), or move "
                    "the router (--set router.port=N)",
                )
            seen[port] = owner


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


def expand(cfg: Config, raw: Mapping[str, Any]) -> Config:
    """The cluster Config: one worker per slot, from the [[prefill]]/[[decode]] templates."""
    spec = cfg.cluster
    assert spec is not None
    for role in ("prefill", "decode"):
        if len(raw.get(role) or []) > 1:
            raise UserError(
                f"the config lists {len(raw[role])} [[{role}]] workers and a cluster plan (cluster.boxes = "
                f"{spec.boxes}): in a cluster, [[{role}]] entry 0 is the template of every {role} slot",
                f"set the number of {role} workers with --{role} N (cluster.{role}) and keep one [[{role}]] entry",
            )
    if spec.hosts and len(spec.hosts) != spec.boxes:
        raise UserError(f"cluster.hosts names {len(spec.hosts)} host(s) for {spec.boxes} box(es)",
                        "give one host per box, in box order (e.g. --hosts node1,node2), or none at all")
    engine_mem = (raw.get("engine") or {}).get("mem_fraction_static")
    workers: list[WorkerSpec] = []
    for slot in layout(spec):
        template = dict((raw.get(slot.role) or [{}])[0])
        tp, size = template.get("tp", 1), len(spec.slot_gpus[slot.slot])
        if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and size % tp:
            raise UserError(
                f"cluster.slot_gpus[{slot.slot}] has {size} GPU(s), which a {slot.role} worker of TP {tp} cannot use "
                "(a worker is one slot: the GPUs of one NUMA node)",
                f"give every slot a multiple of {tp} GPUs (--set cluster.slot_gpus=[[0,1,2,3],[4,5,6,7]]), or "
                f"--set {slot.role}.0.tp=N with N a divisor of {size}")
        template.pop("bootstrap_port", None)
        host = bind_host(spec.bind_host, spec.hosts, slot.box)
        entry = {**template, **slot_ports(spec, slot), "gpus": list(spec.slot_gpus[slot.slot]), "numa_node": None,
                 "host": host}
        w = _worker(slot.role, slot.index, entry, engine_mem)
        env = _with_network(w.env, spec.network) + side_channel_env(host)  # a worker's own UCX_TLS too
        workers.append(replace(w, box=slot.box, advertise=spec.hosts[slot.box] if spec.hosts else "", env=env))
    _check_ports(cfg, spec, workers)
    return replace(cfg, workers=tuple(workers), env=_with_network(cfg.env, spec.network))


def boxes_of(cfg: Config) -> dict[int, tuple[WorkerSpec, ...]]:
    out: dict[int, list[WorkerSpec]] = {}
    for w in cfg.workers:
        out.setdefault(w.box or 0, []).append(w)
    return {b: tuple(ws) for b, ws in sorted(out.items())}


def select(cfg: Config, box: int | None = None, role: str | None = None, index: int | None = None) -> Config:
    """What one `up` of a cluster starts: box K's slots, one worker (a pod), or the router.

    The others stay in the Config as remote workers: the router's argv names all of them, and the
    router's readiness gate waits for their /health before it starts.
    """
    spec = cfg.cluster
    if spec is None:
        raise UserError("--box/--role select part of a cluster plan, but this config has no cluster (cluster.boxes = 0)",
                        "pass --cluster-plan FILE (from `v4flash-pd render slurm|k8s`), or drop --box/--role")
    if (box is None) == (role is None):
        raise UserError("a cluster plan is started one part at a time: give exactly one of --box K or --role ROLE",
                        f"--box 0..{spec.boxes - 1} starts that box's workers (Slurm), --role router the router, "
                        "--role prefill|decode --index I one worker (a Kubernetes pod)")
    if box is not None:
        if not 0 <= box < spec.boxes:
            raise UserError(f"--box {box} is not a box of this {spec.boxes}-box cluster plan",
                            f"use --box 0..{spec.boxes - 1}")
        keep = {w.name for w in cfg.workers if w.box == box}
        return replace(cfg, workers=tuple(replace(w, remote=w.name not in keep) for w in cfg.workers), router=None)
    if role not in CLUSTER_ROLES:
        raise UserError(f"--role {role!r} is not a part of a cluster plan", f"use one of: {', '.join(CLUSTER_ROLES)}")
    if role == "router":
        missing = [w.name for w in cfg.workers if not w.advertise]
        if missing:
            raise UserError(
                f"the router must reach workers on other boxes, but the cluster plan names no host for "
                f"{', '.join(missing[:4])}{'...' if len(missing) > 4 else ''}",
                "pass the boxes' host names in box order: --hosts node1,node2 (env V4FLASH_CLUSTER_HOSTS; the "
                "rendered sbatch script sets it from `scontrol show hostnames`)",
            )
        return replace(cfg, workers=tuple(replace(w, remote=True) for w in cfg.workers))
    count = len(cfg.role(role))
    if index is None or not 0 <= index < count:
        got = "none was given" if index is None else f"got {index}"
        raise UserError(f"--role {role} needs --index 0..{count - 1} (this plan has {count} {role} worker(s)); {got}",
                        "pass --index I (env V4FLASH_INDEX; the rendered pods set it from their index label)")
    name = f"{role}-{index}"
    return replace(cfg, workers=tuple(replace(w, remote=w.name != name) for w in cfg.workers), router=None)


# ------------------------------------------------------------ the cluster plan file


def plan_document(raw: Mapping[str, Any], profile: str, cfg: Config) -> dict[str, Any]:
    """cluster-plan.json: the merged config (what every box rebuilds its plan from) and, for people,
    where each worker runs."""
    spec = cfg.cluster
    assert spec is not None
    slots = [{"name": w.name, "role": w.role, "box": w.box, "gpus": list(w.gpus), "port": w.port,
              "bootstrap_port": w.bootstrap_port, "nccl_port": w.nccl_port, "host": w.advertise or None}
             for w in cfg.workers]
    keep = {k: v for k, v in raw.items() if k != "profile"}
    return {"format": PLAN_FORMAT, "profile": profile, "boxes": spec.boxes, "slots": slots, "config": keep}


def read_plan(path: Path | None, text: str | None = None) -> tuple[dict[str, Any], str]:
    """(raw config, profile) from a cluster plan file, or from its text (the sbatch script passes it
    in V4FLASH_CLUSTER_PLAN_JSON, so nodes need no shared file system)."""
    where = f"cluster plan {path}" if path is not None else "V4FLASH_CLUSTER_PLAN_JSON"
    if text is None:
        assert path is not None
        text = read_text_file(path, "cluster plan", "pass the cluster-plan.json that `v4flash-pd render` wrote")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{where} is not valid JSON ({exc})",
                        "render it again with `v4flash-pd render slurm|k8s`; do not edit it by hand") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or not isinstance(doc.get("config"), dict):
        got = f"format {doc.get('format')!r}" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}, not an object"
        raise UserError(f"{where} is not a v4flash-pd cluster plan ({got}; want format {PLAN_FORMAT!r})",
                        "pass the cluster-plan.json written by `v4flash-pd render slurm|k8s` of this version")
    profile = doc.get("profile")
    if not isinstance(profile, str):
        raise UserError(f"{where} has no profile name", "render it again with `v4flash-pd render slurm|k8s`")
    if profile not in PROFILES:  # the plan stands in for the profile layer: an unknown one must not mean defaults
        raise UserError(f"{where} names unknown profile {profile!r}, which this v4flash-pd does not have",
                        f"render it again with `v4flash-pd render slurm|k8s` of this version (profiles: "
                        f"{', '.join(sorted(PROFILES))})")
    return doc["config"], profile


# ------------------------------------------------------------ planning every part (plan, render)


def slot_topology(spec: ClusterSpec) -> Topology:
    """The box a cluster plan assumes (slot s = NUMA node s), for showing plans before any box is
    probed; each box's `up` plans with its own probed topology."""
    gpus = tuple(Gpu(index=g, name="(probed by `up` on the box)", bus_id="", numa_node=s)
                 for s, slot in enumerate(spec.slot_gpus) for g in slot)
    nodes = tuple(NumaNode(id=s, cpus="") for s in range(len(spec.slot_gpus)))
    return Topology(gpus=gpus, nodes=nodes, source="cluster.slot_gpus (each box probes its own at `up`)")


def placeholder_hosts(cfg: Config) -> Config:
    """Until the scheduler says where the boxes are, box K is called box-K in shown plans."""
    spec = cfg.cluster
    assert spec is not None
    if spec.hosts:
        return cfg
    hosts = tuple(f"box-{k}" for k in range(spec.boxes))
    bound = spec.bind_host == ADVERTISE  # shown bound to the name that stands for the box's address
    workers = tuple(replace(w, advertise=hosts[w.box or 0], host=hosts[w.box or 0] if bound else w.host)
                    for w in cfg.workers)
    return replace(cfg, workers=workers, cluster=replace(spec, hosts=hosts))


def part_plans(cfg: Config, topology: Topology | None = None, rehearse: bool = False) -> list[tuple[str, Plan]]:
    """(part, Plan) for every box and the router, each built by the one `build_plan` as that
    box's `up` would (with the assumed or given topology instead of a probe)."""
    from v4flash_pd.host import Host
    from v4flash_pd.plan import build_plan

    spec = cfg.cluster
    assert spec is not None
    shown = placeholder_hosts(cfg)
    host = Host.remote(topology or slot_topology(spec))
    parts = [(f"box {k}", build_plan(select(shown, box=k), host, rehearse=rehearse, require_gpus=False))
             for k in range(spec.boxes)]
    parts.append(("router", build_plan(select(shown, role="router"), host, rehearse=rehearse, require_gpus=False)))
    return parts
