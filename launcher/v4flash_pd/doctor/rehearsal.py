"""`doctor --rehearse`: a rehearsal starts stand-in engines, so GPUs, their peer access and NUMA
layout, the model files, their fit in GPU memory, the serving stack's pins and the KV transport
cannot stop it. Their findings are still shown, as skipped rows that say why, instead of failing
the report (exit 4 for a missing GPU the rehearsal would never touch). Ports, storage, the offline
env, router auth and the plan itself still count.
"""

from __future__ import annotations

from v4flash_pd.doctor.result import ERROR, WARN, Check, skip

# Check families whose findings a rehearsal does not depend on (the stand-ins take no GPU, so no peer
# access either, no weights, no SGLang, no NIXL; the plan skips a NUMA binding this host cannot honour
# and says so; with no weights loaded, the per-GPU memory arithmetic cannot stop it either).
NOT_NEEDED = ("gpu", "p2p", "numa", "model", "memory", "stack", "transport")


def relax(family: str, check: Check) -> Check:
    if family not in NOT_NEEDED or check.status not in (ERROR, WARN):
        return check
    return skip(check.name, f"not needed for a rehearsal ({check.status}: {check.detail})")
