"""Plan: the one pure function that turns (Config, Host) into every argv, env, binding and port.

Nothing else in the code base assembles a command line: `plan` prints this object, `up` executes
it, `doctor` checks it, `--rehearse` builds the same plan with the engine module swapped, so what
was rehearsed is what runs on the GPU box. Every fact about the machine comes from the `Host`
(probed once at the CLI edge, or a topology file for another box), never from this process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from v4flash_pd import docformat
from v4flash_pd.config.keys import PATCH_SWITCHES
from v4flash_pd.config.types import Config, Speculative, WorkerSpec
from v4flash_pd.errors import UserError
from v4flash_pd.host import Host
from v4flash_pd.hostprobe import Binding, numactl_prefix
from v4flash_pd.interconnect import loopback_binds
from v4flash_pd.memory import MOE_SCALE_BYTES, REPACKED_SCALE_BYTES, MemoryFit
from v4flash_pd.memory import fit as memory_arithmetic
from v4flash_pd.ports import WILDCARD_HOSTS, PortUse, is_ip, url_host
from v4flash_pd.topology import UNKNOWN_NODE
from v4flash_pd.workerauth import entry as worker_entry

SGLANG_MODULE = "sglang.launch_server"
REHEARSAL_MODULE = "v4flash_pd.rehearsal.engine"
ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_AUTH_MODULE = "v4flash_pd.routerauth"
# Read at import time by huggingface_hub/transformers (and honoured by the router's tokenizer
# loader): every process gets them from exec, the router included.
OFFLINE_KEYS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")
LOOPBACK_NAMES = {"localhost": ("127.0.0.1", "::1")}
# sglang-router 0.3.2 loads each worker's tokenizer from the model path the worker reports and, when
# that path is not on this box (a rehearsal), downloads it with its Rust hub client, which ignores
# HF_HUB_OFFLINE and reads only HF_ENDPOINT: offline, point that at a closed loopback port so the
# attempt fails at once, locally, and nothing reaches out.
OFFLINE_HF_ENDPOINT = "http://127.0.0.1:1"
# sglang 0.5.13's /health (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, on by default) sends a one-token
# request and checks for a scheduler answer after each `asyncio.sleep(1)`: no answer comes in under
# a second. The watchdog gives a probe hang_timeout/3, so a window below this is all false alarms.
SLOW_HEALTH_WINDOW = 10.0

# What a plan warns about, one code per kind of finding (doctor files each under its own check).
WarningCode = Literal[
    "topology-note",  # the topology probe's own note (no nvidia-smi, ...)
    "gpus-missing",  # the plan uses GPUs the topology lacks (planning another box, a rehearsal)
    "numa-unknown",  # a worker's GPUs sit on no known node, or on several: not bound
    "numa-rehearsal",  # binding skipped in a rehearsal (this host cannot bind)
    "numa-unbindable",  # this host cannot bind the node: `up` will refuse
    "numa-preferred",  # membind refused here: --preferred instead
    "numa-cpu-only",  # no memory policy permitted here: CPUs bound only
    "ucx-module-dir",  # UCX_MODULE_DIR = auto is resolved on the target box
    "ports-busy",  # ports taken on this host now
    "model-missing",  # no usable model directory here
    "router-missing",  # sglang-router is not installed for the workers' interpreter
    "router-open",  # the router listens beyond loopback without authentication
    "server-open",  # the aggregated server listens beyond loopback (it has no authentication)
    "exposed",  # workers, bootstrap, NCCL or metrics listen beyond this box
    "memory-unfit",  # a worker's weights do not fit its static pool: `up` will refuse (plan, rehearsal)
    "memory-tight",  # it fits, but its KV pool or the memory left outside it is short
    "hang-timeout-short",  # hang_timeout below what SGLang's /health can answer in: false hangs
]
WARNING_CODES: tuple[str, ...] = get_args(WarningCode)


@dataclass(frozen=True)
class PlanWarning:
    code: WarningCode
    text: str


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
    index: int = 0  # position in its role list (router: 0)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProcessSpec:
        return cls(name=d["name"], role=d["role"], argv=tuple(d["argv"]), env=_pairs(d["env"]), gpus=tuple(d["gpus"]),
                   binding=Binding(**d["binding"]), ports=tuple(PortUse(**u) for u in d["ports"]),
                   health_url=d["health_url"], index=d["index"])


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
    python: str  # the interpreter every process of the plan runs
    warnings: tuple[PlanWarning, ...] = ()
    patches: tuple[tuple[str, bool], ...] = ()  # kernel patch switches the workers get
    # off in `patches` until `up`'s self-check passed on this box (the switch's `auto`)
    pending_patches: tuple[str, ...] = ()
    context_length: int | None = None
    # How clients authenticate to the router: ("file", path) or ("env", NAME); ("", "") = nobody has to.
    router_auth: tuple[str, str] = ("", "")
    local: bool = True  # planned with this machine's facts (False: for the box a topology file describes)
    # Cluster plans: what part of the cluster this plan starts ("" = everything: one box), and the
    # workers other boxes start that must answer /health before this plan's router starts.
    scope: str = ""
    upstream: tuple[tuple[str, str], ...] = ()
    # Speculative decoding as every worker runs it ("" = off), and each local worker's per-GPU memory.
    speculative: str = ""
    memory: tuple[MemoryFit, ...] = ()

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

    def warned(self, *codes: WarningCode) -> tuple[PlanWarning, ...]:
        return tuple(w for w in self.warnings if w.code in codes)

    def to_dict(self) -> dict[str, Any]:
        return docformat.stamp(docformat.PLAN, asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The Plan `to_dict` wrote (what `up --detach` hands its background launcher)."""
        if docformat.marker_of(d) != docformat.PLAN:
            raise ValueError(f"not a {docformat.PLAN} document (format {docformat.marker_of(d)!r})")
        auth = d["router_auth"]
        return cls(profile=d["profile"], mode=d["mode"], rehearse=d["rehearse"], model_path=d["model_path"],
                   processes=tuple(ProcessSpec.from_dict(p) for p in d["processes"]), url=d["url"],
                   probe_url=d["probe_url"], expected=tuple((r, n) for r, n in d["expected"]), python=d["python"],
                   warnings=tuple(PlanWarning(**w) for w in d["warnings"]),
                   patches=tuple((n, on) for n, on in d["patches"]),
                   pending_patches=tuple(d.get("pending_patches", ())), context_length=d["context_length"],
                   router_auth=(auth[0], auth[1]), local=d["local"], scope=d["scope"], upstream=_pairs(d["upstream"]),
                   speculative=d.get("speculative", ""),
                   memory=tuple(MemoryFit(**m) for m in d.get("memory", ())))


def _pairs(items: list[list[str]]) -> tuple[tuple[str, str], ...]:
    return tuple((a, b) for a, b in items)


def reach_host(host: str) -> str:
    """Where a client on this box connects to reach a listener on `host` (URL form)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return url_host(host)


def _addr_set(name: str, host: Host) -> set[str]:
    if name in WILDCARD_HOSTS:
        return {"*"}
    if is_ip(name):
        return {name}
    found = host.resolve(name)
    if found:
        return set(found)
    return set(LOOPBACK_NAMES.get(name, (name,)))


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _overlap(a: set[str], b: set[str]) -> bool:
    # a wildcard listener (IPv4 or dual-stack IPv6) takes the port on every address
    return "*" in a or "*" in b or bool(a & b)


def worker_url(w: WorkerSpec) -> str:
    """Where the router (and any other box) reaches a worker."""
    return f"http://{url_host(w.advertise) if w.advertise else reach_host(w.host)}:{w.port}"


class _Problems:
    """Collects every reason a plan cannot run, so `up` and `plan` report all of them at once."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, message: str, fix: str) -> None:
        self.items.append((message, fix))

    def raise_if_any(self) -> None:
        if not self.items:
            return
        if len(self.items) == 1:
            raise UserError(*self.items[0])
        msg = f"{len(self.items)} problems: " + " ".join(f"({i}) {m};" for i, (m, _) in enumerate(self.items, 1))
        fix = " ".join(f"({i}) {f};" for i, (_, f) in enumerate(self.items, 1))
        raise UserError(msg.rstrip(";"), fix.rstrip(";"))


def _check_port_collisions(uses: tuple[PortUse, ...], host: Host, problems: _Problems) -> None:
    sets = [_addr_set(u.host, host) for u in uses]
    for i, a in enumerate(uses):
        for j in range(i + 1, len(uses)):
            b = uses[j]
            if a.port == b.port and _overlap(sets[i], sets[j]):
                same = "" if a.host == b.host else f" ({a.host} and {b.host} are the same interface here)"
                problems.add(f"port {a.port} is used twice in the plan: by {a.owner} and by {b.owner}{same}",
                             "give each worker/router port, bootstrap port and NCCL port its own number "
                             "(e.g. --set decode.0.nccl_port=30012)")


def _gpu_node(host: Host, gpu: int) -> int:
    g = host.topology.gpu(gpu)
    return g.numa_node if g is not None else UNKNOWN_NODE


def _intended(cfg: Config, node: int) -> Binding:
    return Binding(node, "preferred" if cfg.numa == "preferred" else "membind")


def decide_binding(cfg: Config, w: WorkerSpec, host: Host, rehearse: bool, strict: bool,
                   warnings: list[PlanWarning], problems: _Problems) -> Binding:
    """Where to bind a worker: its GPUs' node, checked against what the host can honour."""
    if cfg.numa == "off":
        return Binding(None, "none", "numa = off")
    gpu_nodes = {g: _gpu_node(host, g) for g in w.gpus}
    known = {n for n in gpu_nodes.values() if n != UNKNOWN_NODE}
    node = w.numa_node
    key = f"{w.role}.{w.index}.numa_node"
    if node is None:
        if len(known) == 1 and len(set(gpu_nodes.values())) == 1:
            node = known.pop()
        else:
            warnings.append(PlanWarning("numa-unknown", f"{w.name}: GPU->NUMA map unknown or mixed ({gpu_nodes}); "
                                        f"not binding it. Bind it with --set {key}=N."))
            return Binding(None, "none", "GPU NUMA node unknown")
    else:
        wrong = {g: n for g, n in gpu_nodes.items() if n != UNKNOWN_NODE and n != node}
        if wrong:
            problems.add(
                f"{w.name} is bound to NUMA node {node} but its GPUs {sorted(wrong)} sit on node(s) "
                f"{sorted(set(wrong.values()))} (topology {host.topology.source or 'given'})",
                f"--set {key}={sorted(set(wrong.values()))[0]} (the GPUs' node), or move {w.name} to GPUs on "
                f"node {node}; to run without binding --set numa=off",
            )
            return _intended(cfg, node)
    if not host.local:  # planning for another box: assume it can bind
        return _intended(cfg, node)
    problem = ""
    probe = host.node(node)
    if not host.numactl:
        problem = "numactl is not installed on this host"
    elif probe is None or not probe.cpu_ok:
        problem = (f"this host/container cannot bind NUMA node {node}"
                   f" ({probe.detail if probe else 'not probed'}; it has node(s) {list(host.allowed_nodes)})")
    if problem:
        if rehearse:
            warnings.append(PlanWarning("numa-rehearsal",
                                        f"{w.name}: NUMA binding to node {node} skipped in rehearsal: {problem}."))
            return Binding(None, "none", problem)
        if not strict:  # `plan` on a host that cannot run it: show the intended binding, warn
            warnings.append(PlanWarning("numa-unbindable", f"{w.name}: this host cannot honour NUMA node {node}: {problem}; "
                                                           "`up` will refuse."))
            return Binding(node, _intended(cfg, node).policy, problem)
        if not host.numactl:
            fix = ("install numactl (apt-get install numactl) and run on the box the plan describes, or "
                   "--set numa=off to start without binding")
        else:  # numactl works; the node is missing here or outside this container's cpuset
            have = list(host.allowed_nodes) or [0]
            fix = (f"run on the box the plan describes (its GPUs on node {node}), bind a node this host has "
                   f"(--set {key}={have[0]}; it has {have}), or --set numa=off to start without binding")
        problems.add(f"{w.name} must be bound to NUMA node {node}, but {problem}", fix)
        return _intended(cfg, node)
    detail = probe.detail if probe else "not probed"
    if probe is not None and probe.membind_ok and cfg.numa == "bind":
        return Binding(node, "membind")
    if probe is not None and (probe.preferred_ok or probe.membind_ok):
        if cfg.numa == "preferred":
            return Binding(node, "preferred", "numa = preferred")
        warnings.append(PlanWarning(
            "numa-preferred", f"WARNING {w.name}: numactl --membind is not permitted here ({detail}); falling back "
            f"to --preferred={node}: memory may spill to the other socket. In Docker add --cap-add SYS_NICE."))
        return Binding(node, "preferred", detail)
    warnings.append(PlanWarning(
        "numa-cpu-only", f"WARNING {w.name}: no memory policy is permitted here ({detail}); binding CPUs only "
        f"(--cpunodebind={node}), memory follows first touch. In Docker add --cap-add SYS_NICE."))
    return Binding(node, "cpu", detail)


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
    if cfg.context_length is not None:
        a += ["--context-length", str(cfg.context_length)]
    if cfg.chunked_prefill_size is not None and w.role in ("prefill", "server"):
        a += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    if w.mem_fraction_static is not None:
        a += ["--mem-fraction-static", f"{w.mem_fraction_static:g}"]
    if w.cuda_graph_max_bs is not None:
        a += ["--cuda-graph-max-bs", str(w.cuda_graph_max_bs)]
    if cfg.enable_metrics:
        a.append("--enable-metrics")
    a += speculative_args(cfg.speculative)
    if w.role in ("prefill", "decode"):
        a += ["--disaggregation-mode", w.role, "--disaggregation-transfer-backend", str(cfg.transfer_backend)]
        if bootstrap_port is not None:
            a += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return tuple(a) + cfg.engine_extra_args + w.extra_args


def speculative_args(spec: Speculative) -> tuple[str, ...]:
    """The same four flags for every worker (prefill stores the draft state decode rebuilds); top-k is
    always written, since the pinned DeepSeek-V4 hook asserts it equals 1 and None does not."""
    if not spec.on:
        return ()
    return ("--speculative-algorithm", spec.algorithm, "--speculative-num-steps", str(spec.num_steps),
            "--speculative-eagle-topk", str(spec.eagle_topk),
            "--speculative-num-draft-tokens", str(spec.num_draft_tokens))


def memory_fit(cfg: Config, w: WorkerSpec, host: Host) -> MemoryFit:
    """Per-GPU memory of a worker on the cards the topology reports (the smallest of its GPUs)."""
    sizes = [g.memory_mib for g in host.topology.gpus if g.index in w.gpus and g.memory_mib]
    graphs = w.cuda_graph_max_bs if w.role in ("decode", "server") else None
    # the moe switch repacks the experts' scales to e8m0 bytes at load time (a quarter of the fp32 ones)
    scales = REPACKED_SCALE_BYTES if cfg.patch_on("moe") else MOE_SCALE_BYTES
    return memory_arithmetic(w.name, w.role, w.index, w.tp, min(sizes) if sizes else None,
                             w.mem_fraction_static, cfg.context_length, cfg.speculative.on, scale_bytes=scales,
                             graph_max_bs=graphs, draft_tokens=cfg.speculative.num_draft_tokens if cfg.speculative.on else 1)


def _memory_findings(fits: tuple[MemoryFit, ...], strict: bool, rehearse: bool,
                     warnings: list[PlanWarning], problems: _Problems) -> None:
    for f in fits:
        if f.status == "error" and strict:
            problems.add(f.finding, f.fix)
        elif f.status == "error":
            then = "rehearsal loads no weights" if rehearse else "`up` will refuse it"
            warnings.append(PlanWarning("memory-unfit", f"memory: {f.finding}; {then} (fix: {f.fix})"))
        elif f.status == "warn":
            warnings.append(PlanWarning("memory-tight", f"memory: {f.finding} (fix: {f.fix})"))


def shared_env(cfg: Config, host: Host, warnings: list[PlanWarning]) -> dict[str, str]:
    """The config's [env] with host-dependent values resolved from the Host."""
    env = dict(cfg.env)
    if env.get("UCX_MODULE_DIR") == "auto":
        if host.ucx_module_dir:
            env["UCX_MODULE_DIR"] = host.ucx_module_dir
        else:
            del env["UCX_MODULE_DIR"]
            if not host.local:
                warnings.append(PlanWarning("ucx-module-dir", "UCX_MODULE_DIR = \"auto\" is resolved by `up` on the target "
                                            "box (nixl-cu13's bundled UCX), so this plan does not show it"))
    return env


def _worker_process(cfg: Config, w: WorkerSpec, binding: Binding, host: Host, python: str, env_base: dict[str, str],
                    rehearse: bool, first_bootstrap: int | None) -> ProcessSpec:
    module = REHEARSAL_MODULE if rehearse else SGLANG_MODULE
    # decode gets prefill-0's bootstrap port as its fallback: SGLang substitutes its own
    # --disaggregation-bootstrap-port when the router sends bootstrap_port = null.
    boot = w.bootstrap_port if w.role == "prefill" else (first_bootstrap if w.role == "decode" else None)
    # behind a router with an API key the worker takes the same key (the router passes it on)
    argv = numactl_prefix(binding, host.numactl) + (python, "-m", *worker_entry(module, cfg.client_auth)) \
        + engine_args(cfg, w, boot)
    # GPU indices come from nvidia-smi, which numbers GPUs in PCI bus order; CUDA's default order
    # (FASTEST_FIRST) need not match, and then CUDA_VISIBLE_DEVICES and the NUMA map disagree.
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **env_base}
    env.update(w.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in w.gpus)
    for name, var in PATCH_SWITCHES:
        env[var] = "1" if cfg.patch_on(name) else "0"
    env["PYTHONUNBUFFERED"] = "1"
    if rehearse:
        env["V4FLASH_REHEARSAL"] = "1"
    ports = tuple(u for u in cfg.port_uses() if u.process == w.name)
    return ProcessSpec(name=w.name, role=w.role, argv=argv, env=tuple(sorted(env.items())), gpus=w.gpus,
                       binding=binding, ports=ports, health_url=f"http://{reach_host(w.host)}:{w.port}/health",
                       index=w.index)


def _router_process(cfg: Config, python: str, env_base: dict[str, str]) -> ProcessSpec:
    r = cfg.router
    assert r is not None
    argv: list[str] = [python, "-m"]
    if r.api_key_file:
        argv += [ROUTER_AUTH_MODULE, "--api-key-file", r.api_key_file, "--"]
    elif r.api_key_env:
        argv += [ROUTER_AUTH_MODULE, "--api-key-env", r.api_key_env, "--"]
    else:
        argv += [ROUTER_MODULE]
    argv.append("--pd-disaggregation")
    for w in cfg.role("prefill"):
        argv += ["--prefill", worker_url(w), str(w.bootstrap_port)]
    for w in cfg.role("decode"):
        argv += ["--decode", worker_url(w)]
    argv += ["--host", r.host, "--port", str(r.port),
             "--prometheus-host", r.metrics_host, "--prometheus-port", str(r.metrics_port),
             # workers are already healthy when the router starts: check them right away
             "--worker-startup-check-interval", "1",
             "--worker-startup-timeout-secs", str(int(max(cfg.ready_timeout, 60)))]
    if r.policy:
        argv += ["--policy", r.policy]
    argv += list(r.extra_args)
    env = {k: v for k, v in env_base.items() if k in OFFLINE_KEYS}
    if env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        env["HF_ENDPOINT"] = OFFLINE_HF_ENDPOINT
    env.update(r.env)
    env["PYTHONUNBUFFERED"] = "1"
    return ProcessSpec(name="router", role="router", argv=tuple(argv), env=tuple(sorted(env.items())), gpus=(),
                       binding=Binding(None, "none", "router is CPU-light"),
                       ports=r.port_uses(),
                       health_url=f"http://{reach_host(r.host)}:{r.port}/readiness")


def _host_problems(cfg: Config, host: Host, rehearse: bool, starting: bool, python: str,
                   warnings: list[PlanWarning], problems: _Problems) -> None:
    """What this machine says about the plan: unresolvable hosts, busy ports, model dir, router."""
    if not host.local:
        return
    for name, addrs in host.addresses:
        if not addrs:
            problems.add(f"host {name!r} in the config does not resolve on this machine",
                         "use an IP address (127.0.0.1 keeps a worker on this box) or fix the name in /etc/hosts or DNS")
    busy = [(u, host.port(u.host, u.port)) for u in cfg.port_uses() if host.port(u.host, u.port)]
    if busy:
        items = ", ".join(f"{u.port} ({u.owner} on {u.host}: {why})" for u, why in busy)
        moves = [f"--set {cfg.port_key(u)}={host.port_instead(u.host, u.port)}" for u, _ in busy
                 if host.port_instead(u.host, u.port)]  # each free when probed, and no role's port
        fix = ("stop whatever holds them (`v4flash-pd down`, or `ss -ltnp` to find it), or move the role to free "
               "ports" + (f", e.g. {' '.join(moves)} (free now)" if moves else ""))
        if any(why.startswith("permission denied") for _, why in busy):
            fix = "use ports >= 1024 (or run with CAP_NET_BIND_SERVICE); " + fix
        if starting:
            problems.add(f"port(s) not available on this host: {items}", fix)
        else:
            warnings.append(PlanWarning("ports-busy",
                                        f"port(s) not available on this host now: {items}; `up` will refuse them"))
    if host.model is not None and not host.model.ok and cfg.local_workers():  # a router alone loads no weights
        if rehearse:
            warnings.append(PlanWarning("model-missing", f"{host.model.problem}; rehearsal does not load weights"))
        elif starting:
            problems.add(f"{host.model.problem}; refusing to start",
                         "pass --model /path/to/DeepSeek-V4-Flash (a dir with config.json and the weights), or mount "
                         "it at the profile's path; `up --rehearse` runs without a model")
        else:
            warnings.append(PlanWarning("model-missing", f"{host.model.problem}; `up` will refuse to start without it"))
    if host.python_ok is False:
        problems.add(f"the workers' interpreter {python!r} (config key python) is not an executable on this host",
                     "--set python=/path/to/python3 of the serving environment, or leave python unset to use the "
                     "interpreter running v4flash-pd")
    if cfg.cluster is not None:  # a box's workers bound to a name that is loopback here: unreachable
        local = [(w.name, w.host, w.box) for w in cfg.local_workers()]
        for msg, fix in loopback_binds(local, cfg.cluster.hosts, host.resolve):
            problems.add(msg, fix)
    if cfg.router is not None and host.router_installed is False:
        msg = f"sglang-router is not installed for {python}, and the plan starts the router with it"
        fix = "pip install sglang-router==0.3.2 (the pinned router; `make demo` sets up an env with it)"
        if starting:
            problems.add(msg, fix)
        else:
            warnings.append(PlanWarning("router-missing", msg + f" ({fix})"))


def build_plan(cfg: Config, host: Host, *, rehearse: bool = False, require_gpus: bool | None = None,
               starting: bool = False) -> Plan:
    """Pure: the same (Config, Host) give the same Plan. Raises one UserError listing everything
    that cannot run.

    `require_gpus` (default: not rehearse): GPUs the topology lacks and NUMA nodes the host cannot
    bind are errors (a real `up`), not warnings (`plan`, rehearsal). `starting` (`up`, rehearsal
    included): busy ports, a missing model dir (real runs) and a missing router are errors too.
    """
    topology = host.topology
    warnings = [PlanWarning("topology-note", f"topology: {n}") for n in topology.notes]
    problems = _Problems()
    strict = (not rehearse) if require_gpus is None else require_gpus
    seen: dict[int, str] = {}
    local = cfg.local_workers()
    for w in local:
        for g in w.gpus:
            if g in seen:
                problems.add(f"GPU {g} is assigned to both {seen[g]} and {w.name}",
                             "give every role its own GPUs (defaults: prefill 0-3, decode 4-7)")
            seen[g] = w.name
    have = {g.index for g in topology.gpus}
    missing = sorted(set(seen) - have)
    if missing:
        msg = (f"the plan uses GPUs {sorted(seen)} but the topology ({topology.source or 'given'}) has "
               f"{len(have)} GPU(s){': ' + str(sorted(have)) if have else ''}")
        if strict:
            problems.add(msg, "run on the 8-GPU box the profile targets, pick GPUs that exist "
                              "(--set prefill.0.gpus=[0,1]), or describe the target box with --topology FILE")
        else:
            warnings.append(PlanWarning("gpus-missing", msg + " (fine for a rehearsal or for planning another box)"))
    if cfg.hang_timeout < SLOW_HEALTH_WINDOW and local:
        warnings.append(PlanWarning(
            "hang-timeout-short",
            f"hang_timeout = {cfg.hang_timeout:g}s is short: SGLang's /health generates one token and polls for "
            f"the answer once a second, and each probe may take hang_timeout/3, so a healthy but busy worker "
            f"can be declared hung and the whole run stopped; use >= {SLOW_HEALTH_WINDOW:g}s "
            "(--set hang_timeout=60, the default)"))
    python = cfg.python or host.python
    _host_problems(cfg, host, rehearse, starting, python, warnings, problems)
    bindings = {w.name: decide_binding(cfg, w, host, rehearse, strict, warnings, problems) for w in local}
    fits = tuple(memory_fit(cfg, w, host) for w in local)
    _memory_findings(fits, strict, rehearse, warnings, problems)
    env_base = shared_env(cfg, host, warnings)
    prefills = cfg.role("prefill")
    first_boot = prefills[0].bootstrap_port if prefills else None
    procs = [_worker_process(cfg, w, bindings[w.name], host, python, env_base, rehearse, first_boot)
             for w in local]
    expected: tuple[tuple[str, int], ...] = ()
    auth: tuple[str, str] = ("", "")
    upstream: tuple[tuple[str, str], ...] = ()
    if cfg.mode == "pd" and cfg.router is None:  # one box (or pod) of a cluster: its workers only
        if not local:
            problems.add("this part of the cluster plan starts nothing", "select a box with workers (--box K)")
            problems.raise_if_any()
        url = worker_url(local[0])
        probe_url = f"http://{reach_host(local[0].host)}:{local[0].port}"
    elif cfg.mode == "pd":
        assert cfg.router is not None
        r = cfg.router
        upstream = tuple((w.name, worker_url(w) + "/health") for w in cfg.workers if w.remote)
        procs.append(_router_process(cfg, python, env_base))
        url = f"http://{url_host(r.host)}:{r.port}"
        if cfg.cluster is not None and cfg.cluster.hosts and r.host in WILDCARD_HOSTS:
            url = f"http://{url_host(cfg.cluster.hosts[0])}:{r.port}"  # the router runs on box 0
        probe_url = f"http://{reach_host(r.host)}:{r.port}"
        expected = (("prefill", len(prefills)), ("decode", len(cfg.role("decode"))))
        auth = cfg.client_auth
        if not auth[0]:
            where = "every interface" if r.host in WILDCARD_HOSTS else r.host
            warnings.append(PlanWarning(
                "router-open", f"the router listens on {where} port {r.port} WITHOUT authentication: anyone who can "
                "reach it can generate; set router.api_key_file (or router.api_key_env), or keep "
                "router.host = \"127.0.0.1\" behind a reverse proxy"))
        exposed = [u for u in cfg.port_uses() if (u.process, u.kind) != ("router", "http") and not _loopback(u.host)]
        if exposed and cfg.cluster is None:
            warnings.append(PlanWarning(
                "exposed", "listening beyond this box: " + ", ".join(f"{u.owner} on {u.host}:{u.port}" for u in exposed)
                + "; workers, bootstrap, NCCL and router metrics need no outside access: keep them on "
                  "127.0.0.1 (the profile's default)"))
    else:
        s = cfg.role("server")[0]
        url = f"http://{url_host(s.host)}:{s.port}"
        probe_url = f"http://{reach_host(s.host)}:{s.port}"
        if not _loopback(s.host):
            warnings.append(PlanWarning(
                "server-open", f"{s.name} listens on {s.host} port {s.port} WITHOUT authentication: anyone who can "
                "reach it can generate; keep it on 127.0.0.1 behind a reverse proxy that authenticates"))
    uses = tuple(u for p in procs for u in p.ports)
    _check_port_collisions(uses, host, problems)
    problems.raise_if_any()
    return Plan(profile=cfg.profile, mode=cfg.mode, rehearse=rehearse, model_path=cfg.model_path,
                processes=tuple(procs), url=url, probe_url=probe_url, expected=expected, python=python,
                warnings=tuple(warnings),
                patches=cfg.patches, pending_patches=cfg.pending_patches, context_length=cfg.context_length,
                router_auth=auth, local=host.local,
                scope=plan_scope(cfg), upstream=upstream, speculative=cfg.speculative.summary(), memory=fits)


def plan_scope(cfg: Config) -> str:
    """What part of a cluster this plan starts, in words ("" for a one-box plan)."""
    if cfg.cluster is None:
        return ""
    local = cfg.local_workers()
    if cfg.router is not None and not local:
        return f"router of a {cfg.cluster.boxes}-box cluster"
    boxes = sorted({w.box for w in local if w.box is not None})
    if len(local) < len(cfg.workers):
        return f"box {','.join(map(str, boxes))} of {cfg.cluster.boxes}: {', '.join(w.name for w in local)}"
    return f"the whole {cfg.cluster.boxes}-box cluster"
