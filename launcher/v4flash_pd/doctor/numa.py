"""numactl present, and `--membind` permitted on every node the plan binds to.

Docker's default seccomp profile refuses set_mempolicy/mbind without CAP_SYS_NICE; numactl then
exits 1 and an SGLang scheduler wrapped in it dies with no traceback (sglang#27368). We run the
same kind of command the launcher will (`numactl --cpunodebind=N --membind=N -- true`) per node.
"""

from __future__ import annotations

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn

CAP_FIX = ("give the container CAP_SYS_NICE: `docker run --cap-add SYS_NICE ...` (podman: same flag); "
           "until then the launcher falls back to --preferred, so memory may land on the other socket")


def numactl_path(inp: DoctorInput) -> str | None:
    p = inp.probe
    override = p.env.get("V4FLASH_NUMACTL")
    return override or p.which("numactl")


def classify_membind_failure(text: str) -> str:
    """'perm' (no CAP_SYS_NICE), 'node' (node absent / outside the cpuset), or 'other'."""
    t = text.lower()
    if "operation not permitted" in t or "permission denied" in t or "eperm" in t:
        return "perm"
    if "out of range" in t or "invalid" in t or "no such" in t:
        return "node"
    return "other"


def run(inp: DoctorInput) -> list[Check]:
    e = inp.expect
    if e.numa_mode == "off":
        return [skip("numactl", "numa = off in the config"), skip("numa-membind", "numa = off in the config")]
    numactl = numactl_path(inp)
    if not numactl:
        return [error("numactl", "numactl is not installed; workers cannot be bound to their GPUs' socket",
                      "install it (apt-get install numactl; it is in the image), or set numa = \"off\""),
                skip("numa-membind", "numactl is missing")]
    out = [ok("numactl", f"found {numactl}")]
    nodes = e.numa_nodes_used() or (0,)
    if not inp.topology_is_local:
        out.append(skip("numa-membind", "--topology describes another box; membind is probed on the box itself"))
        return out
    perm, bad_node, other, good = [], [], [], []
    for n in nodes:
        r = inp.probe.run([numactl, f"--cpunodebind={n}", f"--membind={n}", "--", "true"], 20.0)
        if r.rc == 0:
            good.append(n)
            continue
        first = r.text.splitlines()[0] if r.text else f"exit {r.rc}"
        kind = classify_membind_failure(r.text)
        (perm if kind == "perm" else bad_node if kind == "node" else other).append((n, first))
    if bad_node or other:
        items = "; ".join(f"node {n}: {why}" for n, why in bad_node + other)
        return out + [error("numa-membind", f"numactl --membind failed ({items})",
                            "this host/container does not have the NUMA nodes the plan binds to: run on the box "
                            "the profile targets, do not restrict --cpuset-mems, or set each worker's numa_node "
                            "to a node listed by `numactl --hardware`")]
    if perm:
        items = "; ".join(f"node {n}: {why}" for n, why in perm)
        return out + [warn("numa-membind", f"membind not permitted ({items})", CAP_FIX)]
    if inp.expect.numa_mode == "preferred":
        return out + [ok("numa-membind", f"membind works on node(s) {good} (config asks for --preferred)")]
    return out + [ok("numa-membind", f"numactl --cpunodebind/--membind works on node(s) {good}")]
