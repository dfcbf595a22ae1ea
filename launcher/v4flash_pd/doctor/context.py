"""What the doctor compares the machine against: expectations derived once from the Config.

Checks never read the config themselves; they get an `Expect` (plain data) plus the Topology and
the Probe, so a fixture can state "this plan, on that box" in a few lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from v4flash_pd.config import Config
from v4flash_pd.doctor.probe import Probe
from v4flash_pd.ports import PortUse
from v4flash_pd.topology import Topology

# CUDA 13.0 needs an R580+ driver (CUDA 13.0 release notes, minimum driver 580.xx).
MIN_DRIVER_MAJOR = 580
# What each profile family targets: (compute capability, GPU name fragment).
PROFILE_GPUS: dict[str, tuple[str, str]] = {"rtx6000": ("12.0", "RTX PRO 6000")}


@dataclass(frozen=True)
class WorkerExpect:
    name: str
    role: str
    gpus: tuple[int, ...]
    numa_node: int | None


@dataclass(frozen=True)
class Expect:
    profile: str = ""
    mode: str = "pd"
    model_path: str = ""
    tokenizer_path: str = ""
    numa_mode: str = "bind"
    transfer_backend: str | None = "nixl"
    compute_cap: str = ""  # "" = no expectation
    gpu_name: str = ""
    workers: tuple[WorkerExpect, ...] = ()
    ports: tuple[PortUse, ...] = ()
    worker_env: Mapping[str, str] = field(default_factory=dict)  # what the plan adds to the workers' env
    min_driver_major: int = MIN_DRIVER_MAJOR

    def gpus_used(self) -> tuple[int, ...]:
        return tuple(sorted({g for w in self.workers for g in w.gpus}))

    def numa_nodes_used(self) -> tuple[int, ...]:
        return tuple(sorted({w.numa_node for w in self.workers if w.numa_node is not None}))


@dataclass(frozen=True)
class DoctorInput:
    expect: Expect
    topology: Topology
    probe: Probe
    topology_is_local: bool = True  # False when --topology FILE describes another box


def profile_gpu(profile: str) -> tuple[str, str]:
    for prefix, want in PROFILE_GPUS.items():
        if profile.startswith(prefix):
            return want
    return ("", "")


def expect_from_config(cfg: Config) -> Expect:
    """Expectations from a validated Config. Ports come from the real plan builder (fed an empty
    topology so it cannot refuse on GPU/NUMA grounds: those are doctor's own checks), so doctor
    checks exactly the ports `up` would use."""
    from v4flash_pd.plan import build_plan

    plan = build_plan(cfg, Topology(gpus=(), nodes=()), None, rehearse=False, require_gpus=False)
    env: dict[str, str] = {}
    for p in plan.processes:
        if p.role != "router":
            env.update(dict(p.env))
    cap, name = profile_gpu(cfg.profile)
    return Expect(
        profile=cfg.profile, mode=cfg.mode, model_path=cfg.model_path, tokenizer_path=cfg.tokenizer_path,
        numa_mode=cfg.numa, transfer_backend=cfg.transfer_backend if cfg.mode == "pd" else None,
        compute_cap=cap, gpu_name=name,
        workers=tuple(WorkerExpect(w.name, w.role, w.gpus, w.numa_node) for w in cfg.workers),
        ports=plan.port_uses(), worker_env=env,
    )
