"""GPU checks: driver vs CUDA 13, GPU inventory vs the profile, GPU->NUMA map vs the plan."""

from __future__ import annotations

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn
from v4flash_pd.topology import UNKNOWN_NODE


def driver_major(version: str) -> int | None:
    try:
        return int(version.strip().split(".")[0])
    except ValueError:
        return None


def check_driver(inp: DoctorInput) -> Check:
    topo, want = inp.topology, inp.expect.min_driver_major
    if not topo.driver_version:
        why = "; ".join(topo.notes) or "nvidia-smi reported no GPUs"
        return error("nvidia-driver", f"no NVIDIA driver found ({why})",
                     "install the NVIDIA driver (>= 580 for CUDA 13) and, in a container, run with "
                     "--gpus all / --device nvidia.com/gpu=all; or point V4FLASH_NVIDIA_SMI at nvidia-smi")
    major = driver_major(topo.driver_version)
    if major is None:
        return warn("nvidia-driver", f"cannot parse driver version {topo.driver_version!r}",
                    f"check `nvidia-smi`; CUDA 13 needs driver >= {want}")
    if major < want:
        return error("nvidia-driver", f"driver {topo.driver_version} is too old for CUDA 13.0 (needs >= {want})",
                     f"upgrade the host driver to R{want} or newer (the pinned torch/sglang-kernel are CUDA 13 "
                     "builds and fail with 'CUDA driver version is insufficient')")
    return ok("nvidia-driver", f"driver {topo.driver_version} supports CUDA 13.0 (>= {want})")


def check_gpus(inp: DoctorInput) -> Check:
    e, gpus = inp.expect, inp.topology.gpus
    if not gpus:
        return error("gpus", "no GPUs visible", "see nvidia-driver above; in a container pass the GPUs in")
    need = e.gpus_used()
    have = {g.index for g in gpus}
    missing = [g for g in need if g not in have]
    summary = f"{len(gpus)} x " + ", ".join(sorted({f'{g.name} (sm_{g.compute_cap.replace(".", "")})' for g in gpus}))
    if missing:
        return error("gpus", f"the plan uses GPUs {list(need)} but only {sorted(have)} exist ({summary})",
                     "run on the box the profile targets, or change the workers' gpus in the config")
    used = [g for g in gpus if g.index in need]
    if e.compute_cap:
        wrong = [g for g in used if g.compute_cap and g.compute_cap != e.compute_cap]
        if wrong:
            caps = sorted({g.compute_cap for g in wrong})
            return error("gpus", f"profile {e.profile} expects compute capability {e.compute_cap} "
                                 f"(sm_{e.compute_cap.replace('.', '')}) but GPUs {[g.index for g in wrong]} are {caps}",
                         "pick the profile for this GPU family (--profile), or run on RTX PRO 6000 (sm_120) GPUs; "
                         "the sparse-MLA decode kernels are built for sm_120")
    if e.gpu_name:
        odd = [g for g in used if e.gpu_name.lower() not in g.name.lower()]
        if odd:
            return warn("gpus", f"profile {e.profile} targets {e.gpu_name}, found {sorted({g.name for g in odd})}",
                        "memory fractions and CUDA-graph sizes are tuned for the profile's GPU; check them")
    return ok("gpus", summary)


def check_numa_map(inp: DoctorInput) -> Check:
    e, topo = inp.expect, inp.topology
    if e.numa_mode == "off":
        return skip("gpu-numa", "numa = off in the config: workers are not bound")
    if not topo.gpus:
        return skip("gpu-numa", "no GPUs to map")
    problems, unknown, fixes = [], [], []
    node_ids = set(topo.node_ids())
    for w in e.workers:
        nodes = {g: gpu.numa_node if (gpu := topo.gpu(g)) is not None else UNKNOWN_NODE for g in w.gpus}
        known = {g: n for g, n in nodes.items() if n != UNKNOWN_NODE}
        unknown += [g for g, n in nodes.items() if n == UNKNOWN_NODE]
        if w.numa_node is None:
            if len(set(known.values())) > 1:
                problems.append(f"{w.name} GPUs span NUMA nodes {sorted(set(known.values()))}")
                fixes.append(f"give {w.name} GPUs on one socket")
            continue
        wrong = {g: n for g, n in known.items() if n != w.numa_node}
        if wrong:
            actual = sorted(set(wrong.values()))
            problems.append(f"{w.name} is planned on node {w.numa_node} but GPUs {sorted(wrong)} are on node(s) {actual}")
            fixes.append(f"--set {w.role}.{w.index}.numa_node={actual[0]} (or give {w.name} GPUs on node {w.numa_node})")
        if node_ids and w.numa_node not in node_ids:
            problems.append(f"{w.name} is planned on node {w.numa_node}, which this box does not have "
                            f"(nodes {sorted(node_ids)})")
            fixes.append(f"--set {w.role}.{w.index}.numa_node=N with N one of {sorted(node_ids)}")
    mapping = ", ".join(f"GPU{g.index}->{g.numa_node if g.numa_node != UNKNOWN_NODE else '?'}" for g in topo.gpus)
    if problems:
        return error("gpu-numa", "; ".join(problems) + f" [{mapping}]",
                     "; ".join(fixes) + ". Binding a worker to the wrong socket puts its memory on the far side "
                                        "of the inter-socket link")
    if unknown:
        return warn("gpu-numa", f"sysfs reports no NUMA node (-1) for GPUs {sorted(set(unknown))}; cannot verify "
                                f"the plan [{mapping}]",
                    "on a VM or with NUMA off in BIOS this is expected; on the real box check "
                    "/sys/bus/pci/devices/<bus id>/numa_node and `nvidia-smi topo -m`")
    return ok("gpu-numa", f"matches the plan [{mapping}]")


def run(inp: DoctorInput) -> list[Check]:
    return [check_driver(inp), check_gpus(inp), check_numa_map(inp)]
