"""numactl present, and the plan's own numactl prefixes work on this host.

Docker's default seccomp profile refuses set_mempolicy/mbind without CAP_SYS_NICE; numactl then
exits 1 and an SGLang scheduler wrapped in it dies with no traceback. The plan already probed
this host and fell back where it had to; doctor runs each worker's exact prefix (`<prefix> true`)
and says loudly when the plan had to settle for less than --membind.
"""

from __future__ import annotations

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn

CAP_FIX = ("give the container CAP_SYS_NICE: `docker run --cap-add SYS_NICE ...` (podman: same flag); "
           "until then the launcher falls back to --preferred, so memory may land on the other socket")


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
    numactl = e.numactl  # the Host's: what the plan's prefixes run
    if not numactl:
        return [error("numactl", "numactl is not installed; workers cannot be bound to their GPUs' socket",
                      "install it (apt-get install numactl; it is in the image), or --set numa=off"),
                skip("numa-membind", "numactl is missing")]
    out = [ok("numactl", f"found {numactl}")]
    bound = [w for w in e.workers if w.numactl_argv]
    if not bound:
        return out + [skip("numa-membind", "the plan binds no worker (GPU NUMA nodes unknown)")]
    failed, weaker, good = [], [], []
    for w in bound:
        r = inp.probe.run(list(w.numactl_argv), 20.0)
        if r.rc != 0:
            first = r.text.splitlines()[0] if r.text else f"exit {r.rc}"
            failed.append((w, first))
        elif w.policy != "membind" and e.numa_mode == "bind":
            weaker.append(w)
        else:
            good.append(w)
    if failed:
        items = "; ".join(f"{w.name} ({' '.join(w.numactl_argv[1:-2])}): {why}" for w, why in failed)
        perm = all(classify_membind_failure(why) == "perm" for _, why in failed)
        return out + [error("numa-membind", f"the plan's numactl prefix fails: {items}",
                            CAP_FIX if perm else
                            "this host/container does not have the NUMA nodes the plan binds to: run on the box the "
                            "profile targets, do not restrict --cpuset-mems, or --set <role>.<i>.numa_node=N with a node "
                            "listed by `numactl --hardware`")]
    if weaker:
        items = "; ".join(f"{w.name} node {w.numa_node} gets "
                          f"--{'preferred' if w.policy == 'preferred' else 'cpunodebind only'} ({w.reason})"
                          for w in weaker)
        return out + [warn("numa-membind", f"membind not permitted: {items}", CAP_FIX)]
    nodes = sorted({w.numa_node for w in good if w.numa_node is not None})
    how = "--preferred (numa = preferred)" if e.numa_mode == "preferred" else "--cpunodebind/--membind"
    return out + [ok("numa-membind", f"the plan's numactl {how} prefixes work on node(s) {nodes}")]
