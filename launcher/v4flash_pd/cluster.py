"""Cluster plans at plan level: what one box (or one pod, or the router) starts, the cluster plan
file every box rebuilds its Config from, and every part's Plan for `plan` and `render`.

A cluster plan is still a `Config` (its workers are the slots that `config.layout` placed, named
prefill-i / decode-j across the whole cluster) and still goes through the one `build_plan`: a box
plans its own slots and treats the others as remote, the router plans only itself and waits for
all of them. Nothing here assembles a command line.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from v4flash_pd import docformat
from v4flash_pd.config.layout import ADVERTISE
from v4flash_pd.config.types import ClusterSpec, Config
from v4flash_pd.errors import UserError
from v4flash_pd.host import Host
from v4flash_pd.plan import Plan, build_plan
from v4flash_pd.profiles import PROFILES
from v4flash_pd.textfile import read_text_file
from v4flash_pd.topology import Gpu, NumaNode, Topology

PLAN_FORMAT = docformat.CLUSTER_PLAN
CLUSTER_ROLES = ("router", "prefill", "decode")



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
    return docformat.stamp(PLAN_FORMAT, {"profile": profile, "boxes": spec.boxes, "slots": slots, "config": keep})


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
    if docformat.marker_of(doc) != PLAN_FORMAT or not isinstance(doc.get("config"), dict):
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
    spec = cfg.cluster
    assert spec is not None
    shown = placeholder_hosts(cfg)
    host = Host.remote(topology or slot_topology(spec))
    parts = [(f"box {k}", build_plan(select(shown, box=k), host, rehearse=rehearse, require_gpus=False))
             for k in range(spec.boxes)]
    parts.append(("router", build_plan(select(shown, role="router"), host, rehearse=rehearse, require_gpus=False)))
    return parts
