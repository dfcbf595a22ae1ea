"""Host: every fact about the machine a plan runs on, gathered once at the CLI edge.

`build_plan(cfg, host)` reads facts only from here, so a plan is a pure function of its inputs
and `plan --topology other-box.json` cannot pick up this machine's interpreter, nixl install,
numactl permissions, busy ports or model directory: `Host.remote` carries the topology file and
nothing else. `probe_host` is the only function that looks at this machine.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from v4flash_pd import topology as topo
from v4flash_pd.config.types import Config
from v4flash_pd.hostprobe import NodeProbe, allowed_mem_nodes, probe_node
from v4flash_pd.model import ModelCheck, check_model_dir
from v4flash_pd.ports import is_ip, port_problem

REMOTE_PYTHON = "python3"  # the image's interpreter: what a plan for another box runs
NIXL_PKG = "nixl_cu13"


@dataclass(frozen=True)
class PortState:
    host: str
    port: int
    problem: str  # '' = free now
    instead: int = 0  # when not free: a port that is, which no role of the config uses (0: none found)


@dataclass(frozen=True)
class Host:
    topology: topo.Topology
    local: bool  # True: the facts below were probed on the machine that will run the plan
    python: str = REMOTE_PYTHON
    numactl: str = ""  # path, '' = not installed (or not known: remote)
    allowed_nodes: tuple[int, ...] = ()  # Mems_allowed of this process
    nodes: tuple[NodeProbe, ...] = ()  # one per NUMA node the config would bind to
    ucx_module_dir: str = ""  # nixl-cu13's bundled UCX transports; '' = nixl not installed
    router_installed: bool | None = None  # None = not known (another interpreter, another box)
    python_ok: bool | None = None  # the config's `python` runs here; None = not asked (remote, or the default)
    addresses: tuple[tuple[str, tuple[str, ...]], ...] = ()  # host name -> its addresses; () = unresolvable
    ports: tuple[PortState, ...] = ()
    model: ModelCheck | None = None
    notes: tuple[str, ...] = field(default=())

    @classmethod
    def remote(cls, topology: topo.Topology) -> Host:
        """Another box, described by a topology file: nothing of this machine leaks into its plan."""
        return cls(topology=topology, local=False)

    def node(self, node: int) -> NodeProbe | None:
        return next((n for n in self.nodes if n.node == node), None)

    def resolve(self, name: str) -> tuple[str, ...] | None:
        """Addresses `name` has on this host; None when not probed (remote or not asked)."""
        return dict(self.addresses).get(name)

    def port(self, host: str, port: int) -> str:
        return next((p.problem for p in self.ports if p.host == host and p.port == port), "")

    def port_instead(self, host: str, port: int) -> int:
        """A free port to move a busy one to (0: none found, or the port is not busy)."""
        return next((p.instead for p in self.ports if p.host == host and p.port == port), 0)


def planned_nodes(cfg: Config, topology: topo.Topology) -> tuple[int, ...]:
    """Every NUMA node the config could bind a worker to: explicit numa_node or its GPUs' node."""
    if cfg.numa == "off":
        return ()
    nodes: set[int] = set()
    for w in cfg.local_workers():
        if w.numa_node is not None:
            nodes.add(w.numa_node)
        for g in w.gpus:
            gpu = topology.gpu(g)
            if gpu is not None and gpu.numa_node >= 0:
                nodes.add(gpu.numa_node)
    return tuple(sorted(nodes))


def ucx_module_dir() -> str:
    """Where nixl-cu13 bundles UCX's CUDA transports, found without importing nixl."""
    import importlib.util

    loaded = sys.modules.get(NIXL_PKG)  # find_spec() may raise for an already imported module
    try:
        spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec(NIXL_PKG)
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(root).parent / f"{NIXL_PKG}.libs" / "ucx"
        if cand.is_dir():
            return str(cand)
    return ""


def _addresses(name: str) -> tuple[str, ...]:
    import socket

    if is_ip(name):
        return (name,)
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return ()
    return tuple(sorted({str(i[4][0]) for i in infos}))


def config_hosts(cfg: Config) -> tuple[str, ...]:
    names = {w.host for w in cfg.local_workers()}
    if cfg.router is not None:
        names |= {cfg.router.host, cfg.router.metrics_host}
    return tuple(sorted(names))


def _port_states(cfg: Config, unresolved: set[str]) -> tuple[PortState, ...]:
    """Each planned port, free or why not; a busy one with a port to move it to that is free now and that
    neither another role nor another suggestion takes (a fix must not name a busy port)."""
    uses = cfg.port_uses()
    taken = {u.port for u in uses}
    states = []
    for u in uses:
        problem = "" if u.host in unresolved else port_problem(u.host, u.port)
        instead = 0
        if problem:
            start = u.port + 1 if u.port >= 1024 else u.port + 8000  # 80 -> 8080: no privilege needed
            instead = next((p for p in range(start, min(start + 100, 65536))
                            if p not in taken and not port_problem(u.host, p)), 0)
            taken.add(instead)
        states.append(PortState(u.host, u.port, problem, instead))
    return tuple(states)


def probe_host(cfg: Config, env: Mapping[str, str] | None = None,
               topology: topo.Topology | None = None) -> Host:
    """Probe this machine for everything `build_plan` needs to plan `cfg` here."""
    import importlib.util
    import shutil

    env = os.environ if env is None else env
    topology = topology if topology is not None else topo.probe(env)
    numactl = env.get("V4FLASH_NUMACTL") or shutil.which("numactl") or ""
    nodes = tuple(probe_node(numactl, n) for n in planned_nodes(cfg, topology)) if numactl else ()
    same_python = cfg.python in ("", sys.executable)
    python_ok = None
    if not same_python:
        found = shutil.which(cfg.python)
        python_ok = found is not None and os.access(found, os.X_OK)
    router = None
    if cfg.router is not None and same_python:
        try:
            router = importlib.util.find_spec("sglang_router") is not None
        except (ImportError, ValueError):
            router = False
    addresses = tuple((h, _addresses(h)) for h in config_hosts(cfg))
    unresolved = {h for h, a in addresses if not a}
    ports = _port_states(cfg, unresolved)
    return Host(topology=topology, local=True, python=sys.executable, numactl=numactl,
                allowed_nodes=allowed_mem_nodes(), nodes=nodes, ucx_module_dir=ucx_module_dir(),
                router_installed=router, python_ok=python_ok, addresses=addresses, ports=ports,
                model=check_model_dir(cfg.model_path))
