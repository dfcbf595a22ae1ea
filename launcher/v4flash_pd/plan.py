"""Plan: the one pure function that turns (Config, Topology, host facts) into every argv and env.

Nothing else in the code base assembles a command line: `plan` prints this object, `up` executes
it, `--rehearse` builds the same plan with the engine module swapped, so what was rehearsed is
what runs on the GPU box.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from v4flash_pd.config import Config, WorkerSpec
from v4flash_pd.errors import UserError
from v4flash_pd.hostprobe import HostNuma
from v4flash_pd.model import ModelCheck
from v4flash_pd.ports import PortUse
from v4flash_pd.topology import UNKNOWN_NODE, Topology

SGLANG_MODULE = "sglang.launch_server"
REHEARSAL_MODULE = "v4flash_pd.rehearsal.engine"
ROUTER_MODULE = "sglang_router.launch_router"


@dataclass(frozen=True)
class Binding:
    node: int | None
    policy: str  # "membind" | "preferred" | "cpu" (cpunodebind only) | "none"
    reason: str = ""


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    role: str  # prefill | decode | server | router
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # only what the plan sets; the launcher's environment is inherited
    gpus: tuple[int, ...]
    binding: Binding
    ports: tuple[PortUse, ...]
    health_url: str
    critical: bool = True


@dataclass(frozen=True)
class Plan:
    profile: str
    mode: str
    rehearse: bool
    model_path: str
    processes: tuple[ProcessSpec, ...]
    url: str  # what clients use (router, or the aggregated server)
    probe_url: str  # the same endpoint as reachable from this host (0.0.0.0 -> 127.0.0.1)
    expected: tuple[tuple[str, int], ...]  # (role, count) the router must report healthy
    warnings: tuple[str, ...] = field(default=())

    def workers(self) -> tuple[ProcessSpec, ...]:
        return tuple(p for p in self.processes if p.role != "router")

    def router(self) -> ProcessSpec | None:
        return next((p for p in self.processes if p.role == "router"), None)

    def get(self, name: str) -> ProcessSpec:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(name)

    def port_uses(self) -> tuple[PortUse, ...]:
        return tuple(u for p in self.processes for u in p.ports)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = "v4flash-pd/plan/1"
        return d


def reach_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def _hosts_overlap(a: str, b: str) -> bool:
    # a wildcard listener (IPv4 or dual-stack IPv6) takes the port on every address
    return a == b or a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS


def check_port_collisions(uses: tuple[PortUse, ...]) -> None:
    for i, a in enumerate(uses):
        for b in uses[i + 1:]:
            if a.port == b.port and _hosts_overlap(a.host, b.host):
                raise UserError(
                    f"port {a.port} is used twice in the plan: by {a.owner} and by {b.owner}",
                    "give each worker/router port, bootstrap port and NCCL port its own number "
                    "(e.g. --set decode.0.nccl_port=30012)",
                )


def _gpu_node(topology: Topology, gpu: int) -> int:
    g = topology.gpu(gpu)
    return g.numa_node if g is not None else UNKNOWN_NODE


def decide_binding(cfg: Config, w: WorkerSpec, topology: Topology, host: HostNuma | None,
                   rehearse: bool, warnings: list[str], strict: bool = True) -> Binding:
    """Where to bind a worker: its GPUs' node, checked against what this host can honour."""
    if cfg.numa == "off":
        return Binding(None, "none", "numa = off")
    gpu_nodes = {g: _gpu_node(topology, g) for g in w.gpus}
    known = {n for n in gpu_nodes.values() if n != UNKNOWN_NODE}
    node = w.numa_node
    if node is None:
        if len(known) == 1 and len(set(gpu_nodes.values())) == 1:
            node = known.pop()
        else:
            warnings.append(f"{w.name}: GPU->NUMA map unknown or mixed ({gpu_nodes}); not binding it. "
                            f"Set {w.role}[{w.name.rsplit('-', 1)[1]}].numa_node to bind.")
            return Binding(None, "none", "GPU NUMA node unknown")
    else:
        wrong = {g: n for g, n in gpu_nodes.items() if n != UNKNOWN_NODE and n != node}
        if wrong:
            idx = w.name.rsplit("-", 1)[1]
            raise UserError(
                f"{w.name} is bound to NUMA node {node} but its GPUs {sorted(wrong)} sit on node(s) "
                f"{sorted(set(wrong.values()))} (topology {topology.source or 'given'})",
                f"set {w.role}[{idx}].numa_node to the GPUs' node (or move the role to GPUs on node {node}); "
                "to run without binding set numa = \"off\"",
            )
    if host is None:  # planning for another box: assume it can bind
        return Binding(node, "preferred" if cfg.numa == "preferred" else "membind")
    problem = ""
    if not host.numactl:
        problem = "numactl is not installed on this host"
    elif node not in host.allowed_nodes:
        problem = f"this host/container only has NUMA node(s) {list(host.allowed_nodes)}, not node {node}"
    if problem:
        if rehearse:
            warnings.append(f"{w.name}: NUMA binding to node {node} skipped in rehearsal: {problem}.")
            return Binding(None, "none", problem)
        if not strict:  # `plan` on a host that cannot run it: show the intended binding, warn
            warnings.append(f"{w.name}: this host cannot honour NUMA node {node}: {problem}; `up` will refuse.")
            return Binding(node, "preferred" if cfg.numa == "preferred" else "membind", problem)
        raise UserError(
            f"{w.name} must be bound to NUMA node {node}, but {problem}",
            "install numactl (apt-get install numactl) and run on the box the plan describes, or set "
            "numa = \"off\" (V4FLASH_SET='numa=\"off\"') to start without binding",
        )
    if host.membind_ok and cfg.numa == "bind":
        return Binding(node, "membind")
    if host.preferred_ok or host.membind_ok:
        if cfg.numa == "preferred":
            return Binding(node, "preferred", "numa = preferred")
        warnings.append(
            f"WARNING {w.name}: numactl --membind is not permitted here ({host.detail}); falling back to "
            f"--preferred={node}: memory may spill to the other socket. In Docker add --cap-add SYS_NICE."
        )
        return Binding(node, "preferred", host.detail)
    warnings.append(
        f"WARNING {w.name}: no memory policy is permitted here ({host.detail}); binding CPUs only "
        f"(--cpunodebind={node}), memory follows first touch. In Docker add --cap-add SYS_NICE."
    )
    return Binding(node, "cpu", host.detail)


def numactl_prefix(binding: Binding, numactl: str) -> tuple[str, ...]:
    if binding.policy == "none" or binding.node is None:
        return ()
    if binding.policy == "cpu":
        return (numactl or "numactl", f"--cpunodebind={binding.node}", "--")
    mem = f"--membind={binding.node}" if binding.policy == "membind" else f"--preferred={binding.node}"
    return (numactl or "numactl", f"--cpunodebind={binding.node}", mem, "--")


def engine_args(cfg: Config, w: WorkerSpec, bootstrap_port: int | None) -> tuple[str, ...]:
    """SGLang server flags (verified against the pinned parser by tests/launcher/test_sglang_parser.py)."""
    a: list[str] = ["--model-path", cfg.model_path]
    if cfg.served_name:
        a += ["--served-model-name", cfg.served_name]
    if cfg.tokenizer_path:
        a += ["--tokenizer-path", cfg.tokenizer_path]
    if cfg.trust_remote_code:
        a.append("--trust-remote-code")
    a += ["--tp-size", str(w.tp)]
    if len(w.gpus) > w.tp:
        a += ["--dp-size", str(len(w.gpus) // w.tp)]
    a += ["--host", w.host, "--port", str(w.port), "--nccl-port", str(w.nccl_port)]
    a += ["--kv-cache-dtype", cfg.kv_cache_dtype, "--moe-runner-backend", cfg.moe_runner_backend]
    if w.mem_fraction_static is not None:
        a += ["--mem-fraction-static", f"{w.mem_fraction_static:g}"]
    if w.cuda_graph_max_bs is not None:
        a += ["--cuda-graph-max-bs", str(w.cuda_graph_max_bs)]
    if cfg.enable_metrics:
        a.append("--enable-metrics")
    if w.role in ("prefill", "decode"):
        a += ["--disaggregation-mode", w.role, "--disaggregation-transfer-backend", str(cfg.transfer_backend)]
        if bootstrap_port is not None:
            a += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return tuple(a) + cfg.engine_extra_args + w.extra_args


def _worker_process(cfg: Config, w: WorkerSpec, binding: Binding, host: HostNuma | None,
                    rehearse: bool, first_bootstrap: int | None) -> ProcessSpec:
    module = REHEARSAL_MODULE if rehearse else SGLANG_MODULE
    # decode gets prefill-0's bootstrap port as its fallback: SGLang substitutes its own
    # --disaggregation-bootstrap-port when the router sends bootstrap_port = null.
    boot = w.bootstrap_port if w.role == "prefill" else (first_bootstrap if w.role == "decode" else None)
    argv = numactl_prefix(binding, host.numactl if host else "") + (cfg.python, "-m", module) + engine_args(cfg, w, boot)
    # GPU indices come from nvidia-smi, which numbers GPUs in PCI bus order; CUDA's default order
    # (FASTEST_FIRST) need not match, and then CUDA_VISIBLE_DEVICES and the NUMA map disagree.
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **dict(cfg.env)}
    env.update(w.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in w.gpus)
    env["V4FLASH_SPARSE_DECODE"] = "1" if cfg.sparse_decode else "0"
    env["PYTHONUNBUFFERED"] = "1"
    if rehearse:
        env["V4FLASH_REHEARSAL"] = "1"
    ports = [PortUse(f"{w.name} http", w.host, w.port), PortUse(f"{w.name} nccl", w.host, w.nccl_port)]
    if w.role == "prefill" and w.bootstrap_port is not None:
        ports.append(PortUse(f"{w.name} bootstrap", w.host, w.bootstrap_port))
    return ProcessSpec(name=w.name, role=w.role, argv=argv, env=tuple(sorted(env.items())), gpus=w.gpus,
                       binding=binding, ports=tuple(ports),
                       health_url=f"http://{reach_host(w.host)}:{w.port}/health")


def _router_process(cfg: Config) -> ProcessSpec:
    r = cfg.router
    assert r is not None
    argv: list[str] = [cfg.python, "-m", ROUTER_MODULE, "--pd-disaggregation"]
    for w in cfg.role("prefill"):
        argv += ["--prefill", f"http://{reach_host(w.host)}:{w.port}", str(w.bootstrap_port)]
    for w in cfg.role("decode"):
        argv += ["--decode", f"http://{reach_host(w.host)}:{w.port}"]
    argv += ["--host", r.host, "--port", str(r.port),
             "--prometheus-host", r.metrics_host, "--prometheus-port", str(r.metrics_port),
             # workers are already healthy when the router starts: check them right away
             "--worker-startup-check-interval", "1",
             "--worker-startup-timeout-secs", str(int(max(cfg.ready_timeout, 60)))]
    if r.policy:
        argv += ["--policy", r.policy]
    argv += list(r.extra_args)
    env = dict(r.env)
    env["PYTHONUNBUFFERED"] = "1"
    return ProcessSpec(name="router", role="router", argv=tuple(argv), env=tuple(sorted(env.items())), gpus=(),
                       binding=Binding(None, "none", "router is CPU-light"),
                       ports=(PortUse("router http", r.host, r.port), PortUse("router metrics", r.metrics_host, r.metrics_port)),
                       health_url=f"http://{reach_host(r.host)}:{r.port}/readiness")


def build_plan(cfg: Config, topology: Topology, host: HostNuma | None = None, *, rehearse: bool = False,
               model: ModelCheck | None = None, require_gpus: bool | None = None) -> Plan:
    """Pure: the same inputs give the same Plan. Raises UserError for anything that cannot run.

    `host=None` plans for the box `topology` describes (no local NUMA checks); `model=None` skips
    the model-dir check; `require_gpus` (default: not rehearse) refuses GPUs the topology lacks and
    NUMA nodes this host cannot bind (otherwise both are warnings, for `plan`).
    """
    warnings: list[str] = list(f"topology: {n}" for n in topology.notes)
    require_gpus = (not rehearse) if require_gpus is None else require_gpus
    seen: dict[int, str] = {}
    for w in cfg.workers:
        for g in w.gpus:
            if g in seen:
                raise UserError(f"GPU {g} is assigned to both {seen[g]} and {w.name}",
                                "give every role its own GPUs (defaults: prefill 0-3, decode 4-7)")
            seen[g] = w.name
    have = {g.index for g in topology.gpus}
    missing = sorted(set(seen) - have)
    if missing:
        msg = (f"the plan uses GPUs {sorted(seen)} but the topology ({topology.source or 'given'}) has "
               f"{len(have)} GPU(s){': ' + str(sorted(have)) if have else ''}")
        if require_gpus:
            raise UserError(msg, "run on the 8-GPU box the profile targets, pick GPUs that exist "
                                 "(--set prefill.0.gpus=[0,1]), or describe the target box with --topology FILE")
        warnings.append(msg + " (fine for a rehearsal or for planning another box)")
    if model is not None and not model.ok:
        if rehearse:
            warnings.append(f"{model.problem}; rehearsal does not load weights")
        else:
            warnings.append(f"{model.problem}; `up` will refuse to start without it")

    bindings = {w.name: decide_binding(cfg, w, topology, host, rehearse, warnings, strict=require_gpus)
                for w in cfg.workers}
    prefills = cfg.role("prefill")
    first_boot = prefills[0].bootstrap_port if prefills else None
    procs = [_worker_process(cfg, w, bindings[w.name], host, rehearse, first_boot) for w in cfg.workers]
    expected: tuple[tuple[str, int], ...] = ()
    if cfg.mode == "pd":
        router = _router_process(cfg)
        procs.append(router)
        assert cfg.router is not None
        url = f"http://{cfg.router.host}:{cfg.router.port}"
        probe_url = f"http://{reach_host(cfg.router.host)}:{cfg.router.port}"
        expected = (("prefill", len(prefills)), ("decode", len(cfg.role("decode"))))
    else:
        s = cfg.role("server")[0]
        url = f"http://{s.host}:{s.port}"
        probe_url = f"http://{reach_host(s.host)}:{s.port}"
    plan = Plan(profile=cfg.profile, mode=cfg.mode, rehearse=rehearse, model_path=cfg.model_path,
                processes=tuple(procs), url=url, probe_url=probe_url, expected=expected, warnings=tuple(warnings))
    check_port_collisions(plan.port_uses())
    return plan
