"""What the config chain produces: a frozen `Config` of workers, router and cluster layout.

Plain data with the questions only the config can answer (its roles, its port uses and which
key moves each port); no checks and no host facts live here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from v4flash_pd.ports import PortUse


@dataclass(frozen=True)
class WorkerSpec:
    """One SGLang server process group (one TP group)."""

    name: str
    role: str
    index: int  # position in its role list: `--set <role>.<index>.key=...` addresses it
    gpus: tuple[int, ...]
    tp: int
    numa_node: int | None
    host: str
    port: int
    bootstrap_port: int | None
    nccl_port: int
    cuda_graph_max_bs: int | None
    mem_fraction_static: float | None
    extra_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # Cluster plans only: the box it runs on, the name other boxes reach it by ("" = its own host
    # seen from this box), and whether this process plans it (False: another box starts it).
    box: int | None = None
    advertise: str = ""
    remote: bool = False

    def port_uses(self) -> tuple[PortUse, ...]:
        uses = [PortUse(self.name, "http", self.host, self.port), PortUse(self.name, "nccl", self.host, self.nccl_port)]
        if self.role == "prefill" and self.bootstrap_port is not None:
            uses.append(PortUse(self.name, "bootstrap", self.host, self.bootstrap_port))
        return tuple(uses)


@dataclass(frozen=True)
class ClusterSpec:
    """How many boxes, which roles go where, and how workers on different boxes reach each other."""

    boxes: int
    prefill: int
    decode: int
    slot_gpus: tuple[tuple[int, ...], ...]
    http_port: int
    bootstrap_port: int
    nccl_port: int
    port_offset: int
    bind_host: str
    network: str
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class RouterSpec:
    host: str
    port: int
    metrics_host: str
    metrics_port: int
    policy: str
    extra_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # Client authentication: the router's `--api-key` guards /generate and the OpenAI routes. The
    # secret is read by our router wrapper at start from this file or variable, never put in argv.
    api_key_file: str = ""
    api_key_env: str = ""

    @property
    def auth(self) -> str:
        if self.api_key_file:
            return f"api key from file {self.api_key_file}"
        if self.api_key_env:
            return f"api key from ${self.api_key_env}"
        return ""

    def port_uses(self) -> tuple[PortUse, ...]:
        return (PortUse("router", "http", self.host, self.port),
                PortUse("router", "metrics", self.metrics_host, self.metrics_port))


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding as every worker runs it (prefill and decode must match); off while num_steps = 0."""

    algorithm: str = "EAGLE"
    num_steps: int = 0
    eagle_topk: int = 1
    num_draft_tokens: int = 0  # resolved: num_steps + 1 when on, 0 when off

    @property
    def on(self) -> bool:
        return self.num_steps > 0

    def summary(self) -> str:
        """One line for `plan` and the READY banner ("" when off)."""
        if not self.on:
            return ""
        return (f"{self.algorithm} with the MTP layer: {self.num_steps} draft step(s), top-k {self.eagle_topk}, "
                f"{self.num_draft_tokens} tokens verified per step")


# The config key that moves each kind of port, inside a worker table or the router table.
WORKER_PORT_KEYS = {"http": "port", "nccl": "nccl_port", "bootstrap": "bootstrap_port"}
ROUTER_PORT_KEYS = {"http": "router.port", "metrics": "router.metrics_port"}


@dataclass(frozen=True)
class Config:
    profile: str
    mode: str
    model_path: str
    served_name: str
    tokenizer_path: str
    transfer_backend: str | None
    kv_cache_dtype: str
    moe_runner_backend: str
    trust_remote_code: bool
    enable_metrics: bool
    context_length: int | None
    chunked_prefill_size: int | None
    engine_extra_args: tuple[str, ...]
    numa: str
    patches: tuple[tuple[str, bool], ...]  # (name, on) in the registry's order
    python: str  # "" = the interpreter the Host names (this one locally, python3 on another box)
    ready_timeout: float
    grace_period: float
    hang_timeout: float
    smoke_prompt: str
    env: tuple[tuple[str, str], ...]
    workers: tuple[WorkerSpec, ...]
    router: RouterSpec | None
    sources: tuple[str, ...] = field(default=())
    cluster: ClusterSpec | None = None
    speculative: Speculative = field(default=Speculative())
    # Where the router's API key comes from, ("file", path) / ("env", NAME) or ("", ""). Kept when a
    # cluster part drops the router: its workers take the same key (workerauth.py).
    client_auth: tuple[str, str] = ("", "")
    # switches at `auto` (off in `patches`): `up` switches each on once its self-check passed here
    pending_patches: tuple[str, ...] = ()

    def role(self, role: str) -> tuple[WorkerSpec, ...]:
        return tuple(w for w in self.workers if w.role == role)

    def local_workers(self) -> tuple[WorkerSpec, ...]:
        """The workers this process plans and starts (all of them, except in a cluster selection)."""
        return tuple(w for w in self.workers if not w.remote)

    def worker(self, name: str) -> WorkerSpec:
        return next(w for w in self.workers if w.name == name)

    def patch_on(self, name: str) -> bool:
        return dict(self.patches)[name]

    def port_uses(self) -> tuple[PortUse, ...]:
        """Every port this config's local processes listen on, in plan order (the Host probes exactly these)."""
        uses = [u for w in self.local_workers() for u in w.port_uses()]
        if self.router is not None:
            uses += self.router.port_uses()
        return tuple(uses)

    def port_key(self, use: PortUse) -> str:
        """The config key that moves `use` (for a fix: `--set <key>=N`)."""
        if use.process == "router":
            return ROUTER_PORT_KEYS[use.kind]
        w = self.worker(use.process)
        return f"{w.role}.{w.index}.{WORKER_PORT_KEYS[use.kind]}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
