"""Cluster plans as pure functions: the slot layout (N boxes x NUMA slots, slot-major, prefill first),
ports per slot and box, the network transport KV needs between boxes, what `--box/--role/--index`
select, each part's Plan from the one `build_plan`, and the cluster-plan.json round trip.

No process starts here; the CLI side is tests/launcher/test_cluster_cli.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from v4flash_pd import topology as topo
from v4flash_pd.cluster import PLAN_FORMAT, part_plans, plan_document, read_plan, select
from v4flash_pd.config.build import build_config, cluster_spec
from v4flash_pd.config.layers import merged_layers, set_keys
from v4flash_pd.config.layout import expand, layout
from v4flash_pd.config.load import load_config
from v4flash_pd.config.types import Config
from v4flash_pd.errors import UserError
from v4flash_pd.host import Host
from v4flash_pd.plan import Plan, build_plan

FIXTURES = Path(__file__).parent / "fixtures"
T8 = FIXTURES / "topology-8gpu-2node.json"  # GPUs 0-3 on NUMA node 0, 4-7 on node 1
SWAPPED = FIXTURES / "topology-8gpu-swapped.json"  # GPUs 0-3 on node 1, 4-7 on node 0
HOSTS = ["node-a", "node-b"]


def cluster(*sets: str, boxes: int = 2, prefill: int = 1, decode: int = 1, **keys: Any) -> Config:
    """A cluster Config from the default profile: `keys` are cluster.* keys, `sets` any --set items."""
    overrides = {"cluster.boxes": boxes, "cluster.prefill": prefill, "cluster.decode": decode}
    overrides.update({f"cluster.{k}": v for k, v in keys.items()})
    return load_config(env={}, overrides=overrides, sets=sets)


def refused(fn: Any, *args: Any, **kw: Any) -> UserError:
    with pytest.raises(UserError) as info:
        fn(*args, **kw)
    err = info.value
    assert err.message and err.hint, "every refusal names the problem and the fix"
    assert "\n" not in err.message and "\n" not in err.hint, err.render()
    return err


def placement(cfg: Config) -> list[tuple[str, int | None, tuple[int, ...]]]:
    return [(w.name, w.box, w.gpus) for w in cfg.workers]


def remote(path: Path = T8) -> Host:
    return Host.remote(topo.load(path))


def argv_of(plan: Plan, name: str) -> list[str]:
    return list(plan.get(name).argv)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


S0, S1 = (0, 1, 2, 3), (4, 5, 6, 7)  # the GPUs of NUMA slot 0 and slot 1 (cluster.slot_gpus)


# ------------------------------------------------------------------ layout


def test_1p1d_on_two_boxes_puts_prefill_on_box_0_and_decode_on_box_1_both_in_slot_0() -> None:
    cfg = cluster()
    assert placement(cfg) == [("prefill-0", 0, S0), ("decode-0", 1, S0)]
    assert [(s.box, s.slot, s.name) for s in layout(cfg.cluster)] == [(0, 0, "prefill-0"), (1, 0, "decode-0")]


def test_2p2d_on_two_boxes_puts_prefill_on_slot_0_and_decode_on_slot_1_of_every_box() -> None:
    cfg = cluster(prefill=2, decode=2)
    assert placement(cfg) == [("prefill-0", 0, S0), ("prefill-1", 1, S0), ("decode-0", 0, S1), ("decode-1", 1, S1)]
    assert [(s.box, s.slot) for s in layout(cfg.cluster)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_3p1d_on_two_boxes_fills_slot_0_first_then_slot_1() -> None:
    cfg = cluster(prefill=3, decode=1)
    assert placement(cfg) == [("prefill-0", 0, S0), ("prefill-1", 1, S0), ("prefill-2", 0, S1), ("decode-0", 1, S1)]


def test_workers_come_from_the_role_templates_not_from_the_one_box_entries() -> None:
    """[[decode]] entry 0 is the template of every decode slot; gpus/ports/numa_node come from the slot."""
    cfg = cluster("decode.0.cuda_graph_max_bs=48", prefill=2, decode=2)
    assert [w.cuda_graph_max_bs for w in cfg.role("decode")] == [48, 48]
    assert all(w.numa_node is None for w in cfg.workers)  # the profile's numa_node = 1 is the one-box slot's
    assert all(w.host == "0.0.0.0" for w in cfg.workers)  # cluster.bind_host: other boxes must reach them


def test_three_slots_per_box() -> None:
    cfg = cluster("prefill.0.tp=2", "decode.0.tp=2", prefill=3, decode=3, slot_gpus=[[0, 1], [2, 3], [4, 5]])
    assert placement(cfg) == [("prefill-0", 0, (0, 1)), ("prefill-1", 1, (0, 1)), ("prefill-2", 0, (2, 3)),
                              ("decode-0", 1, (2, 3)), ("decode-1", 0, (4, 5)), ("decode-2", 1, (4, 5))]
    assert [w.port for w in cfg.workers] == [30000, 30000, 30001, 30001, 30002, 30002]


@pytest.mark.parametrize("boxes, prefill, decode, want_boxes", [(1, 2, 1, 2), (2, 3, 2, 3), (2, 4, 1, 3), (1, 1, 2, 2)])
def test_more_workers_than_slots_is_refused(boxes: int, prefill: int, decode: int, want_boxes: int) -> None:
    err = refused(cluster, boxes=boxes, prefill=prefill, decode=decode)
    assert f"{prefill} prefill + {decode} decode workers = {prefill + decode} slots" in err.message
    assert f"hold {boxes * 2}" in err.message
    assert f"--boxes {want_boxes}" in err.hint


@pytest.mark.parametrize("boxes, prefill, decode, used", [(3, 1, 1, 2), (4, 2, 1, 3), (5, 2, 2, 4)])
def test_a_box_that_would_run_nothing_is_refused(boxes: int, prefill: int, decode: int, used: int) -> None:
    err = refused(cluster, boxes=boxes, prefill=prefill, decode=decode)
    assert "would run nothing" in err.message and f"{boxes}-box cluster" in err.message
    assert f"--boxes {used}" in err.hint


# ------------------------------------------------------------------ ports


def ports(cfg: Config) -> dict[str, tuple[int, int, int | None]]:
    return {w.name: (w.port, w.nccl_port, w.bootstrap_port) for w in cfg.workers}


def test_ports_follow_the_slot_and_repeat_on_every_box_without_an_offset() -> None:
    cfg = cluster(prefill=2, decode=2)
    assert ports(cfg) == {"prefill-0": (30000, 30010, 8998), "prefill-1": (30000, 30010, 8998),
                          "decode-0": (30001, 30011, None), "decode-1": (30001, 30011, None)}


def test_port_offset_moves_every_port_of_box_k_by_k_times_the_offset() -> None:
    cfg = cluster(prefill=2, decode=2, port_offset=2)
    assert ports(cfg) == {"prefill-0": (30000, 30010, 8998), "prefill-1": (30002, 30012, 9000),
                          "decode-0": (30001, 30011, None), "decode-1": (30003, 30013, None)}


def test_port_bases_come_from_the_cluster_table() -> None:
    cfg = cluster(prefill=1, decode=1, http_port=31000, nccl_port=32000, bootstrap_port=9100, port_offset=5)
    assert ports(cfg) == {"prefill-0": (31000, 32000, 9100), "decode-0": (31005, 32005, None)}


def test_a_one_box_entrys_bootstrap_port_does_not_leak_into_the_slots() -> None:
    cfg = cluster("prefill.0.bootstrap_port=7777", prefill=2, decode=2, port_offset=2)
    assert [w.bootstrap_port for w in cfg.role("prefill")] == [8998, 9000]


@pytest.mark.parametrize("offset, port, first, second", [
    (1, 30001, "prefill-1 http", "decode-0 http"),  # box 1 slot 0 = box 0 slot 1
    (10, 30010, "prefill-0 nccl", "prefill-1 http"),  # box 1's http ports run into box 0's NCCL ports
])
def test_colliding_ports_in_one_network_namespace_are_refused(offset: int, port: int, first: str, second: str) -> None:
    err = refused(cluster, prefill=2, decode=2, port_offset=offset)
    assert f"port {port} is used twice" in err.message and "one network namespace" in err.message
    assert first in err.message and second in err.message
    assert "port_offset" in err.hint


def test_colliding_base_ports_are_refused_per_box() -> None:
    err = refused(cluster, prefill=2, decode=2, nccl_port=30001)
    assert "port 30001 is used twice on box 0" in err.message
    assert "decode-0 http" in err.message and "prefill-0 nccl" in err.message


@pytest.mark.parametrize("key, port, owner, worker", [
    ("router.port", 30000, "router http", "prefill-0 http"),
    ("router.metrics_port", 30010, "router metrics", "prefill-0 nccl"),
    ("router.port", 8998, "router http", "prefill-0 bootstrap"),
])
def test_router_ports_colliding_with_box_0_are_refused(key: str, port: int, owner: str, worker: str) -> None:
    err = refused(cluster, f"{key}={port}")
    assert f"port {port} is used twice on box 0" in err.message
    assert owner in err.message and worker in err.message
    assert "router.port" in err.hint


def test_router_port_colliding_with_another_box_in_one_namespace_is_refused() -> None:
    err = refused(cluster, "router.port=30002", prefill=2, decode=2, port_offset=2)
    assert "port 30002" in err.message and "prefill-1 http" in err.message and "router http" in err.message


# ------------------------------------------------------------------ the network transport


def tls(cfg: Config) -> list[str]:
    return dict(cfg.env)["UCX_TLS"].split(",")


def test_ucx_tls_keeps_the_profiles_transports_and_carries_tcp_by_default() -> None:
    one_box = load_config(env={})
    cfg = cluster()
    assert cfg.cluster is not None and cfg.cluster.network == "tcp"
    assert "tcp" in tls(cfg)
    assert tls(cfg) == tls(one_box)  # the profile's list already has tcp: nothing added, nothing dropped


def test_cluster_network_rc_is_appended_to_ucx_tls() -> None:
    cfg = cluster("cluster.network=rc")
    assert tls(cfg) == tls(load_config(env={})) + ["rc"]


@pytest.mark.parametrize("network", ["tcp", "rc_x"])
def test_a_ucx_tls_without_a_network_transport_gets_one(network: str) -> None:
    cfg = cluster("env.UCX_TLS=cuda_copy,cuda_ipc,sm,self", f"cluster.network={network}")
    assert tls(cfg) == ["cuda_copy", "cuda_ipc", "sm", "self", network]


def test_ucx_tls_all_is_left_alone() -> None:
    assert tls(cluster("env.UCX_TLS=all")) == ["all"]


def test_a_one_box_config_keeps_its_ucx_tls() -> None:
    cfg = load_config(env={}, sets=("env.UCX_TLS=cuda_ipc,sm",))
    assert cfg.cluster is None and tls(cfg) == ["cuda_ipc", "sm"]


def test_every_worker_of_a_box_plan_gets_the_network_transport() -> None:
    cfg = cluster("env.UCX_TLS=cuda_copy,cuda_ipc", "cluster.network=rc", prefill=2, decode=2)
    plan = build_plan(select(cfg, box=1), remote())
    assert {dict(p.env)["UCX_TLS"] for p in plan.processes} == {"cuda_copy,cuda_ipc,rc"}


def test_an_unknown_network_is_refused() -> None:
    err = refused(cluster, "cluster.network=bogus")
    assert "cluster.network = 'bogus'" in err.message
    assert "tcp" in err.hint and "rc" in err.hint


# ------------------------------------------------------------------ config checks


def test_aggregated_mode_with_cluster_boxes_is_refused() -> None:
    err = refused(load_config, profile="rtx6000-tp4", env={}, overrides={"cluster.boxes": 2})
    assert "cluster.boxes = 2" in err.message and "mode = 'aggregated'" in err.message
    assert "rtx6000-8x-pd" in err.hint


def test_more_than_one_prefill_entry_with_a_cluster_is_refused() -> None:
    second = ("prefill.1.gpus=[4,5,6,7]", "prefill.1.tp=4", "prefill.1.port=30002", "prefill.1.nccl_port=30012",
              "prefill.1.bootstrap_port=8999")
    err = refused(cluster, *second, prefill=2, decode=2)
    assert "2 [[prefill]] workers" in err.message and "template" in err.message
    assert "--prefill N" in err.hint


@pytest.mark.parametrize("hosts", [["node-a"], ["node-a", "node-b", "node-c"], "node-a"])
def test_hosts_must_name_one_host_per_box(hosts: Any) -> None:
    err = refused(cluster, hosts=hosts)
    assert "for 2 box(es)" in err.message
    assert "--hosts" in err.hint


def test_hosts_as_a_comma_separated_string_name_the_boxes_in_order() -> None:
    cfg = cluster(hosts="node-a, node-b", prefill=2, decode=2)
    assert cfg.cluster is not None and cfg.cluster.hosts == ("node-a", "node-b")
    assert [(w.name, w.advertise) for w in cfg.workers] == [
        ("prefill-0", "node-a"), ("prefill-1", "node-b"), ("decode-0", "node-a"), ("decode-1", "node-b")]


@pytest.mark.parametrize("key, value, words", [
    ("cluster.slot_gpus", "[[0,1,2,3],[3,4,5,6]]", ["gives a GPU to two slots"]),
    ("cluster.slot_gpus", "[[0,1,2,3],[]]", ["slot_gpus[1]"]),
    ("cluster.nodes", "2", ["unknown config key cluster.'nodes'"]),
    ("cluster.boxes", "-1", ["cluster.boxes", ">= 0"]),
])
def test_bad_cluster_keys_are_refused(key: str, value: str, words: list[str]) -> None:
    err = refused(load_config, env={}, sets=("cluster.boxes=2", f"{key}={value}"))
    for w in words:
        assert w in err.message, (w, err.message)


def test_boxes_0_is_a_one_box_config() -> None:
    cfg = load_config(env={}, overrides={"cluster.boxes": 0})
    assert cfg.cluster is None and all(w.box is None and not w.remote for w in cfg.workers)


# ------------------------------------------------------------------ select


def test_select_box_keeps_that_boxs_workers_local_and_drops_the_router() -> None:
    cfg = cluster(prefill=2, decode=2)
    part = select(cfg, box=1)
    assert part.router is None
    assert [w.name for w in part.workers] == [w.name for w in cfg.workers]  # the others stay, as remote
    assert [w.name for w in part.local_workers()] == ["prefill-1", "decode-1"]
    assert {w.name for w in part.workers if w.remote} == {"prefill-0", "decode-0"}


@pytest.mark.parametrize("box", [2, 5, -1])
def test_select_a_box_outside_the_plan_is_refused(box: int) -> None:
    err = refused(select, cluster(), box=box)
    assert f"--box {box} is not a box of this 2-box cluster plan" in err.message
    assert "--box 0..1" in err.hint


@pytest.mark.parametrize("kw", [{}, {"box": 0, "role": "router"}])
def test_select_needs_exactly_one_of_box_and_role(kw: dict[str, Any]) -> None:
    err = refused(select, cluster(), **kw)
    assert "exactly one of --box K or --role ROLE" in err.message


def test_select_on_a_one_box_config_is_refused() -> None:
    err = refused(select, load_config(env={}), box=0)
    assert "no cluster" in err.message and "--cluster-plan" in err.hint


def test_select_router_needs_the_hosts() -> None:
    err = refused(select, cluster(prefill=2, decode=2), role="router")
    assert "names no host for prefill-0, prefill-1, decode-0, decode-1" in err.message
    assert "--hosts" in err.hint


def test_select_router_keeps_the_router_and_every_worker_remote() -> None:
    cfg = cluster(prefill=2, decode=2, hosts=HOSTS)
    part = select(cfg, role="router")
    assert part.router == cfg.router
    assert len(part.workers) == 4 and all(w.remote for w in part.workers) and part.local_workers() == ()


def test_select_one_worker_by_role_and_index() -> None:
    cfg = cluster(prefill=2, decode=1, hosts=HOSTS)
    part = select(cfg, role="prefill", index=1)
    assert part.router is None
    assert [w.name for w in part.local_workers()] == ["prefill-1"]
    assert [w.name for w in select(cfg, role="decode", index=0).local_workers()] == ["decode-0"]


@pytest.mark.parametrize("role, index", [("prefill", None), ("prefill", 2), ("decode", 1), ("decode", -1)])
def test_select_a_worker_outside_the_plan_is_refused(role: str, index: int | None) -> None:
    err = refused(select, cluster(prefill=2, decode=1), role=role, index=index)
    assert f"--role {role} needs --index" in err.message and "--index I" in err.hint


def test_select_an_unknown_role_is_refused() -> None:
    err = refused(select, cluster(), role="server")
    assert "'server'" in err.message and "router, prefill, decode" in err.hint


# ------------------------------------------------------------------ each part's Plan


def test_a_box_plan_starts_only_that_boxs_workers_from_its_slots() -> None:
    cfg = cluster(prefill=2, decode=2, hosts=HOSTS)
    plan = build_plan(select(cfg, box=1), remote())
    assert [p.name for p in plan.processes] == ["prefill-1", "decode-1"]
    assert plan.router() is None and plan.upstream == () and plan.expected == ()
    assert plan.scope == "box 1 of 2: prefill-1, decode-1"
    pre, dec = plan.get("prefill-1"), plan.get("decode-1")
    assert pre.gpus == S0 and dict(pre.env)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert dec.gpus == S1 and dict(dec.env)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    a = argv_of(plan, "prefill-1")
    # cluster.bind_host = "advertise" (the default): box 1's workers listen on box 1's own address only
    assert (flag(a, "--host"), flag(a, "--port"), flag(a, "--nccl-port")) == (HOSTS[1], "30000", "30010")
    assert flag(a, "--disaggregation-bootstrap-port") == "8998" and flag(a, "--disaggregation-mode") == "prefill"
    d = argv_of(plan, "decode-1")
    assert (flag(d, "--port"), flag(d, "--nccl-port"), flag(d, "--disaggregation-mode")) == ("30001", "30011", "decode")
    # NUMA from the topology: slot 0's GPUs sit on node 0, slot 1's on node 1 (T8)
    assert (pre.binding.node, dec.binding.node) == (0, 1)
    assert a[:4] == ["numactl", "--cpunodebind=0", "--membind=0", "--"]
    assert d[:4] == ["numactl", "--cpunodebind=1", "--membind=1", "--"]
    assert {u.port for u in plan.port_uses()} == {30000, 30010, 8998, 30001, 30011}


def test_a_box_plan_with_a_port_offset_listens_on_its_boxs_ports() -> None:
    plan = build_plan(select(cluster(prefill=2, decode=2, port_offset=2), box=1), remote())
    assert sorted(u.port for u in plan.port_uses()) == [9000, 30002, 30003, 30012, 30013]
    a = argv_of(plan, "prefill-1")
    assert (flag(a, "--port"), flag(a, "--nccl-port"), flag(a, "--disaggregation-bootstrap-port")) == (
        "30002", "30012", "9000")


def test_the_numa_node_comes_from_the_topology_not_from_the_slot_number() -> None:
    """On a box whose GPUs 0-3 sit on node 1, slot 0's worker is bound to node 1."""
    cfg = cluster()
    for box, name in ((0, "prefill-0"), (1, "decode-0")):
        plan = build_plan(select(cfg, box=box), remote(SWAPPED))
        p = plan.get(name)
        assert p.binding.node == 1, (name, p.binding)
        assert list(p.argv[:3]) == ["numactl", "--cpunodebind=1", "--membind=1"]


def test_boxes_reuse_the_same_gpus_and_ports_without_a_collision() -> None:
    """1P1D: both boxes run slot 0 (GPUs 0-3, port 30000); each box plans only its own."""
    cfg = cluster()
    plans = [build_plan(select(cfg, box=k), remote()) for k in (0, 1)]
    assert [[p.name for p in plan.processes] for plan in plans] == [["prefill-0"], ["decode-0"]]
    assert plans[0].get("prefill-0").gpus == plans[1].get("decode-0").gpus == S0
    assert plans[1].get("decode-0").binding.node == 0


def test_the_router_plan_names_every_worker_at_its_host() -> None:
    cfg = cluster(prefill=2, decode=2, hosts=HOSTS)
    plan = build_plan(select(cfg, role="router"), remote())
    assert [p.name for p in plan.processes] == ["router"] and plan.workers() == ()
    a = argv_of(plan, "router")
    i = a.index("--pd-disaggregation")
    assert a[i + 1:i + 11] == ["--prefill", "http://node-a:30000", "8998", "--prefill", "http://node-b:30000", "8998",
                               "--decode", "http://node-a:30001", "--decode", "http://node-b:30001"]
    assert plan.upstream == (("prefill-0", "http://node-a:30000/health"), ("prefill-1", "http://node-b:30000/health"),
                             ("decode-0", "http://node-a:30001/health"), ("decode-1", "http://node-b:30001/health"))
    assert plan.expected == (("prefill", 2), ("decode", 2))
    assert plan.url == "http://node-a:8000"  # the router runs on box 0
    assert plan.scope == "router of a 2-box cluster"
    assert {u.port for u in plan.port_uses()} == {8000, 29000}


def test_the_router_plan_carries_the_port_offset() -> None:
    cfg = cluster(prefill=2, decode=1, hosts=HOSTS, port_offset=2)
    a = argv_of(build_plan(select(cfg, role="router"), remote()), "router")
    assert a[a.index("--pd-disaggregation") + 1:a.index("--host")] == [
        "--prefill", "http://node-a:30000", "8998", "--prefill", "http://node-b:30002", "9000",
        "--decode", "http://node-a:30001"]


def one_box_twin(cfg: Config) -> Config:
    """A one-box config whose workers listen where the cluster's do (host = the box's name): the
    one-box router argv of it must be the cluster router's, because one builder makes both."""
    sets = []
    for k, w in enumerate(cfg.workers):
        at = f"{w.role}.{w.index}"
        sets += [f"{at}.host={w.advertise}", f"{at}.port={w.port}", f"{at}.nccl_port={w.nccl_port}",
                 f"{at}.tp={w.tp}", f"{at}.gpus=[{','.join(str(4 * k + g) for g in range(4))}]"]
        if w.bootstrap_port is not None:
            sets.append(f"{at}.bootstrap_port={w.bootstrap_port}")
    return load_config(env={}, sets=tuple(sets))


@pytest.mark.parametrize("prefill, decode", [(1, 1), (2, 1), (2, 2)])
def test_the_router_argv_is_the_one_box_builders(prefill: int, decode: int) -> None:
    cfg = cluster(prefill=prefill, decode=decode, hosts=HOSTS)
    router = build_plan(select(cfg, role="router"), remote()).get("router")
    twin = one_box_twin(cfg)
    assert twin.cluster is None and len(twin.workers) == prefill + decode
    one_box = build_plan(twin, remote(), require_gpus=False).get("router")
    assert router.argv == one_box.argv
    assert router.env == one_box.env and router.ports == one_box.ports


def test_part_plans_builds_every_box_and_the_router() -> None:
    cfg = cluster(prefill=2, decode=2)
    parts = part_plans(cfg, topo.load(T8))
    assert [name for name, _ in parts] == ["box 0", "box 1", "router"]
    assert [[p.name for p in plan.processes] for _, plan in parts] == [
        ["prefill-0", "decode-0"], ["prefill-1", "decode-1"], ["router"]]
    router = argv_of(parts[2][1], "router")  # no hosts yet: box K is shown as box-K
    assert flag(router, "--prefill") == "http://box-0:30000" and flag(router, "--decode") == "http://box-0:30001"


# ------------------------------------------------------------------ the cluster plan file


def rendered(*sets: str, **cluster_keys: Any) -> tuple[dict[str, Any], str, Config]:
    overrides = {"cluster.boxes": 2, **{f"cluster.{k}": v for k, v in cluster_keys.items()}}
    raw, profile, sources = merged_layers(env={}, overrides=overrides, sets=sets)
    return raw, profile, expand(build_config(raw, profile, sources))


def test_plan_document_round_trips_through_read_plan(tmp_path: Path) -> None:
    raw, profile, cfg = rendered("router.port=8100", "decode.0.cuda_graph_max_bs=16", prefill=2, decode=2)
    doc = plan_document(raw, profile, cfg)
    assert doc["format"] == PLAN_FORMAT and doc["profile"] == profile and doc["boxes"] == 2
    assert "profile" not in doc["config"]
    assert [(s["name"], s["box"], s["gpus"], s["port"], s["bootstrap_port"], s["host"]) for s in doc["slots"]] == [
        ("prefill-0", 0, [0, 1, 2, 3], 30000, 8998, None), ("prefill-1", 1, [0, 1, 2, 3], 30000, 8998, None),
        ("decode-0", 0, [4, 5, 6, 7], 30001, None, None), ("decode-1", 1, [4, 5, 6, 7], 30001, None, None)]
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    path = tmp_path / "cluster-plan.json"
    path.write_text(text)
    base = read_plan(path)
    assert base == (doc["config"], profile) == read_plan(None, text)
    again = load_config(env={}, base=base)

    def same(c: Config) -> Config:  # the JSON file sorts [env] by name; order does not matter there
        return replace(c, sources=(), env=tuple(sorted(c.env)))

    assert same(again) == same(cfg)
    assert again.sources[:2] == ("defaults", "cluster-plan")
    host = topo.load(T8)
    assert part_plans(again, host) == part_plans(cfg, host)  # every box builds what was rendered


def test_flags_still_go_on_top_of_a_cluster_plan() -> None:
    raw, profile, cfg = rendered()
    base = read_plan(None, json.dumps(plan_document(raw, profile, cfg)))
    again = load_config(env={}, base=base, overrides={"cluster.hosts": "node-a,node-b"})
    assert [w.advertise for w in again.workers] == HOSTS


def test_plan_document_names_the_hosts_when_known() -> None:
    raw, profile, cfg = rendered(hosts=HOSTS)
    assert [s["host"] for s in plan_document(raw, profile, cfg)["slots"]] == HOSTS


@pytest.mark.parametrize("text, words", [
    ("{not json", ["is not valid JSON"]),
    ("", ["is not valid JSON"]),
    ('{"format": "v4flash-pd/plan/1", "config": {}, "profile": "rtx6000-8x-pd"}',
     ["not a v4flash-pd cluster plan", "'v4flash-pd/plan/1'", PLAN_FORMAT]),
    ("[1, 2]", ["not a v4flash-pd cluster plan"]),
    (f'{{"format": "{PLAN_FORMAT}", "config": [], "profile": "rtx6000-8x-pd"}}', ["not a v4flash-pd cluster plan"]),
    (f'{{"format": "{PLAN_FORMAT}", "config": {{}}}}', ["has no profile name"]),
])
def test_a_bad_plan_file_is_refused(text: str, words: list[str], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    err = refused(read_plan, path)
    assert str(path) in err.message and "render" in err.hint
    for w in words:
        assert w in err.message, (w, err.message)
    env_err = refused(read_plan, None, text)  # the sbatch script's copy in the environment
    assert "V4FLASH_CLUSTER_PLAN_JSON" in env_err.message


@pytest.mark.parametrize("make, words", [
    (lambda t: t / "missing.json", ["does not exist"]),
    (lambda t: t, ["is a directory"]),
    (lambda t: (t / "latin1.json").write_bytes(b'{"x": "\xff"}') and t / "latin1.json", ["not UTF-8"]),
])
def test_an_unreadable_plan_file_is_refused(make: Any, words: list[str], tmp_path: Path) -> None:
    err = refused(read_plan, make(tmp_path))
    assert "cluster plan" in err.message
    for w in words:
        assert w in err.message, (w, err.message)


def test_a_workers_own_ucx_tls_gets_the_network_transport_too() -> None:
    """A per-worker UCX_TLS overrides the global one in the worker's env: it must cross boxes as well."""
    cfg = load_config(env={}, overrides={"cluster.boxes": 2}, sets=("decode.0.env.UCX_TLS=cuda_ipc",))
    decode = next(w for w in cfg.workers if w.name == "decode-0")
    assert dict(decode.env)["UCX_TLS"].split(",") == ["cuda_ipc", "tcp"]
    prefill = next(w for w in cfg.workers if w.name == "prefill-0")
    assert "UCX_TLS" not in dict(prefill.env)


def test_a_pod_binds_the_numa_node_of_the_gpus_it_was_given() -> None:
    """A Kubernetes worker pod sees its 4 GPUs as 0-3 wherever they sit: the node comes from their
    topology (here node 1), never from the worker's index or role."""
    from v4flash_pd.render_k8s import K8sOptions, pod_layer

    raw, profile, sources = merged_layers(env={}, overrides={"cluster.prefill": 2, "cluster.decode": 1})
    set_keys(raw, pod_layer(cluster_spec(raw, "pd"), 4, K8sOptions()))
    cfg = expand(build_config(raw, profile, sources))
    for role, index in (("prefill", 1), ("decode", 0)):
        plan = build_plan(select(cfg, role=role, index=index), remote(SWAPPED))
        (p,) = plan.workers()
        assert p.name == f"{role}-{index}" and p.gpus == (0, 1, 2, 3)
        assert p.binding.node == 1, p.binding
        assert flag(list(p.argv), "--host") == "0.0.0.0"


def test_workers_listen_on_their_boxs_interconnect_address_or_where_they_are_told() -> None:
    """Issue 23, security: workers and the KV bootstrap server (it binds the worker's --host) listened
    on 0.0.0.0 on every box. By default each box binds its own cluster.hosts entry; with an IP the
    KV side channel (SGLANG_HOST_IP) follows; without hosts, or with an explicit bind_host, as told."""
    ips = ["10.1.0.1", "10.1.0.2"]
    cfg = cluster(prefill=2, decode=2, hosts=ips)
    for w in cfg.workers:
        assert w.host == ips[w.box or 0] and dict(w.env)["SGLANG_HOST_IP"] == ips[w.box or 0], w
    named = cluster(prefill=2, decode=2, hosts=HOSTS)
    assert [w.host for w in named.workers] == [HOSTS[w.box or 0] for w in named.workers]
    assert not any("SGLANG_HOST_IP" in dict(w.env) for w in named.workers)  # ZMQ binds numeric addresses only
    assert {w.host for w in cluster(prefill=2, decode=2).workers} == {"0.0.0.0"}  # no hosts known yet
    told = cluster(prefill=2, decode=2, hosts=ips, bind_host="0.0.0.0")
    assert {w.host for w in told.workers} == {"0.0.0.0"}
    assert not any("SGLANG_HOST_IP" in dict(w.env) for w in told.workers)


def test_a_box_name_that_is_loopback_here_is_refused_when_other_boxes_must_reach_it(tmp_path: Path) -> None:
    """Debian maps a host's own name to 127.0.1.1: bound there, the other boxes could never connect."""
    from v4flash_pd.host import Host as _Host

    cfg = select(cluster(prefill=1, decode=1, hosts=["node-a", "node-b"]), box=0)
    here = _Host(topology=topo.load(T8), local=True, addresses=(("node-a", ("127.0.1.1",)),))
    err = refused(build_plan, cfg, here, rehearse=True, require_gpus=False)
    assert "prefill-0 would listen on node-a = 127.0.1.1" in err.message and "bind_host=0.0.0.0" in err.hint
    # logical boxes on one host (CI): every box is the loopback literal, nothing else must reach it
    same = select(cluster(prefill=1, decode=1, hosts=["127.0.0.1", "127.0.0.1"], port_offset=100), box=0)
    assert build_plan(same, _Host(topology=topo.load(T8), local=True), rehearse=True, require_gpus=False)
