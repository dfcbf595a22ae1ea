"""What the doctor checks the machine against: the Plan `up` would execute, and its Host.

Checks never read the config or re-derive anything: `expect_from_plan` copies what they need out
of the one Plan and its Host (bindings and their numactl prefixes, ports, worker env, patch
switches, the workers' interpreter, the numactl binary), so doctor checks exactly what `up` would
start, with the facts `up` would start it with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from v4flash_pd.doctor.probe import Probe
from v4flash_pd.host import Host
from v4flash_pd.hostprobe import numactl_prefix
from v4flash_pd.memory import MemoryFit
from v4flash_pd.plan import Plan
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
    numa_node: int | None  # the node the plan binds it to (None: not bound)
    index: int = 0
    policy: str = "none"  # the plan's binding policy: membind | preferred | cpu | none
    reason: str = ""  # why the plan chose that policy (e.g. membind refused here)
    numactl_argv: tuple[str, ...] = ()  # the plan's own prefix + `true`: what doctor runs


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
    python: str = ""  # the workers' interpreter (the plan's)
    numactl: str = ""  # the numactl the plan's prefixes run ('' = not installed here)
    patches: tuple[tuple[str, bool], ...] = ()
    context_length: int | None = None
    router_auth: tuple[str, str] = ("", "")
    router_host: str = ""
    memory: tuple[MemoryFit, ...] = ()  # the plan's per-GPU memory arithmetic, one per worker

    def gpus_used(self) -> tuple[int, ...]:
        return tuple(sorted({g for w in self.workers for g in w.gpus}))


@dataclass(frozen=True)
class DoctorInput:
    expect: Expect
    topology: Topology
    probe: Probe
    topology_is_local: bool = True  # False when the GPU list came from a --topology file
    # Ports a run that is up right now holds (its run dir's plan and live processes): port -> that run, e.g.
    # "the running rehearsal /runs/x". Doctor beside that run reports them as the run's, not as busy.
    running: Mapping[int, str] = field(default_factory=dict)


def profile_gpu(profile: str) -> tuple[str, str]:
    for prefix, want in PROFILE_GPUS.items():
        if profile.startswith(prefix):
            return want
    return ("", "")


def expect_from_plan(plan: Plan, host: Host, *, numa_mode: str, tokenizer_path: str = "",
                     transfer_backend: str | None = None) -> Expect:
    """Everything the checks compare against, read off the Plan and its Host (never re-derived)."""
    env: dict[str, str] = {}
    workers = []
    for p in plan.workers():
        env.update(dict(p.env))
        prefix = numactl_prefix(p.binding, host.numactl)  # the plan's own prefix: the same builder, the same binary
        workers.append(WorkerExpect(p.name, p.role, p.gpus, p.binding.node, p.index, p.binding.policy,
                                    p.binding.reason, prefix + ("true",) if prefix else ()))
    router = plan.router()
    cap, name = profile_gpu(plan.profile)
    return Expect(
        profile=plan.profile, mode=plan.mode, model_path=plan.model_path, tokenizer_path=tokenizer_path,
        numa_mode=numa_mode, transfer_backend=transfer_backend if plan.mode == "pd" else None,
        compute_cap=cap, gpu_name=name, workers=tuple(workers), ports=plan.port_uses(), worker_env=env,
        python=plan.python, numactl=host.numactl, patches=plan.patches, context_length=plan.context_length,
        router_auth=plan.router_auth, router_host=router.ports[0].host if router is not None else "",
        memory=plan.memory,
    )
