"""Every port the plan names must be free before `up` (SGLang's bind-then-close port picking
races between two servers on one box, dynamo#15099, so nothing is left to chance)."""

from __future__ import annotations

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip


def run(inp: DoctorInput) -> list[Check]:
    uses = inp.expect.ports
    if not uses:
        return [skip("ports", "the plan names no ports")]
    if not inp.topology_is_local:
        return [skip("ports", "--topology describes another box; ports are checked on the box itself")]
    busy = [u for u in uses if not inp.probe.port_free(u.host, u.port)]
    if busy:
        items = ", ".join(f"{u.owner} {u.host or '0.0.0.0'}:{u.port}" for u in busy)
        first = busy[0]
        return [error("ports", f"in use: {items}",
                      f"stop what holds them (`ss -ltnp 'sport = :{first.port}'`; a previous run: "
                      "`v4flash-pd down`) or move the role to another port in the config")]
    return [ok("ports", f"{len(uses)} port(s) free: " + ", ".join(str(u.port) for u in uses))]
