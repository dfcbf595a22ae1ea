"""Every port the plan names must be free before `up` (SGLang's bind-then-close port picking
races between two servers on one box, so nothing is left to chance)."""

from __future__ import annotations

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn
from v4flash_pd.errors import UserError
from v4flash_pd.routerauth import read_key


def check_router_auth(inp: DoctorInput) -> Check:
    """The router is the one listener meant for clients; say who can use it."""
    e = inp.expect
    if not e.router_host:
        return skip("router-auth", "no router in this plan")
    kind, where = e.router_auth
    if kind:
        try:
            read_key(kind, where, inp.probe.env)
        except UserError as exc:
            return error("router-auth", exc.message, exc.hint)
        return ok("router-auth", f"clients need the API key ({kind} {where}); so do direct requests to the workers, "
                                 "which take the same key")
    if e.router_host in ("0.0.0.0", "::"):
        return warn("router-auth", f"the router listens on every interface ({e.router_host}) without authentication",
                    "set router.api_key_file (or router.api_key_env), or --set router.host=127.0.0.1 behind a "
                    "reverse proxy that authenticates (README: Router authentication)")
    return ok("router-auth", f"no authentication, but the router listens on {e.router_host} only")


def run(inp: DoctorInput) -> list[Check]:
    return [*check_ports(inp), check_router_auth(inp)]


def check_ports(inp: DoctorInput) -> list[Check]:
    uses = inp.expect.ports
    if not uses:
        return [skip("ports", "the plan names no ports")]
    problems = [(u, why) for u in uses if (why := inp.probe.port_problem(u.host, u.port))]
    # a port the run that is up holds for this very role is that run's, not a stranger's
    theirs = [u for u, why in problems if why == "already in use" and u.port in inp.running]
    busy = [(u, why) for u, why in problems if u not in theirs]
    held = "".join(f"; in use by {run}: " + ", ".join(f"{u.port} ({u.owner})" for u in theirs if inp.running[u.port] == run)
                   for run in dict.fromkeys(inp.running[u.port] for u in theirs))
    if busy:
        items = ", ".join(f"{u.owner} {u.host}:{u.port} ({why})" for u, why in busy)
        first = busy[0][0]
        fix = (f"stop what holds them (`ss -ltnp 'sport = :{first.port}'`; a previous run: "
               "`v4flash-pd down`) or move the role to another port (--set router.port=N, --set decode.0.port=N)")
        if any(why.startswith("permission denied") for _, why in busy):
            fix = "use ports >= 1024 or grant CAP_NET_BIND_SERVICE; " + fix
        return [error("ports", f"not available: {items}{held}", fix)]
    free = [u for u in uses if u not in theirs]
    return [ok("ports", f"{len(free)} port(s) free" + (": " + ", ".join(str(u.port) for u in free) if free else "")
               + held)]
