"""Human renderings of plans and states (the JSON forms are the dataclasses' dicts)."""

from __future__ import annotations

import shlex

from v4flash_pd.plan import Plan, ProcessSpec


def command_line(p: ProcessSpec, with_env: bool = True) -> str:
    """The shell-runnable form written to <role>.command and shown by `plan`."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env) if with_env else ""
    argv = " ".join(shlex.quote(a) for a in p.argv)
    return f"env {env} {argv}" if env else argv


def plan_text(plan: Plan, show_commands: bool = True) -> str:
    lines = [
        f"profile  {plan.profile}   mode {plan.mode}{'   REHEARSAL (stand-in engines)' if plan.rehearse else ''}",
        f"model    {plan.model_path or '(none)'}",
        f"url      {plan.url}",
        "",
    ]
    rows = [("NAME", "ROLE", "GPUS", "NUMA", "PORTS")]
    for p in plan.processes:
        b = p.binding
        numa = "-" if b.node is None else f"{b.node} ({b.policy})"
        ports = ", ".join(f"{u.owner.split(' ', 1)[1]} {u.port}" for u in p.ports)
        rows.append((p.name, p.role, ",".join(map(str, p.gpus)) or "-", numa, ports))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    if show_commands:
        lines.append("")
        lines.append("commands:")
        for p in plan.processes:
            lines.append(f"  {p.name}:")
            lines.append(f"    {command_line(p)}")
    if plan.warnings:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)
