"""Human renderings of plans (the JSON form is the dataclass's dict)."""

from __future__ import annotations

import shlex

from v4flash_pd import exposure
from v4flash_pd.config.types import Config
from v4flash_pd.plan import Plan, ProcessSpec
from v4flash_pd.table import format_table


def command_line(p: ProcessSpec, with_env: bool = True) -> str:
    """The shell-runnable form written to <role>.command and shown by `plan`."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env) if with_env else ""
    argv = " ".join(shlex.quote(a) for a in p.argv)
    return f"env {env} {argv}" if env else argv


def auth_text(plan: Plan) -> str:
    kind, where = plan.router_auth
    if plan.router() is None:
        return ""
    if not kind:
        return "NONE: the router accepts requests without authentication"
    return (f"api key (Authorization: Bearer) from {'file ' + where if kind == 'file' else '$' + where}; "
            "the workers take the same key (the router passes it on)")


def patches_text(plan: Plan) -> str:
    """Each switch as the workers get it; an `auto` one says it waits for its self-check."""
    def word(name: str, on: bool) -> str:
        if name in plan.pending_patches:
            return "off until its self-check passes in `up` (auto)"
        return "on" if on else "off"
    return ", ".join(f"{n} {word(n, on)}" for n, on in plan.patches) or "-"


def plan_text(plan: Plan, show_commands: bool = True) -> str:
    patches = patches_text(plan)
    lines = [
        f"profile  {plan.profile}   mode {plan.mode}{'   REHEARSAL (stand-in engines)' if plan.rehearse else ''}",
        f"model    {plan.model_path or '(none)'}   context {plan.context_length or 'SGLang default'}",
        f"url      {plan.url}" + (f"   (from this box: {plan.probe_url})" if plan.probe_url != plan.url else ""),
        f"patches  {patches}",
        "spec     " + (f"{plan.speculative} (the same flags on every worker)" if plan.speculative
                           else "off (--mtp N turns on N draft steps of the MTP layer)"),
    ]
    auth = auth_text(plan)
    if auth:
        lines.append(f"auth     {auth}")
    lines.append("")
    rows = []
    for p in plan.processes:
        b = p.binding
        numa = "-" if b.node is None else f"{b.node} ({b.policy})"
        ports = ", ".join(f"{u.kind} {u.port}" for u in p.ports)
        hosts = sorted({u.host for u in p.ports})
        rows.append((p.name, p.role, ",".join(map(str, p.gpus)) or "-", numa, "/".join(hosts), ports))
    lines += format_table(("NAME", "ROLE", "GPUS", "NUMA", "HOST", "PORTS"), rows)
    if plan.memory:
        lines += ["", *memory_lines(plan)]
    if show_commands:
        lines.append("")
        lines.append("commands:")
        for p in plan.processes:
            lines.append(f"  {p.name}:")
            lines.append(f"    {command_line(p)}")
    exposed = exposure.lines(plan)
    if exposed:
        lines.append("")
        lines.append("reachable from other machines:")
        lines += [f"  - {x}" for x in exposed]
    if plan.warnings:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  - {w.text}" for w in plan.warnings]
    return "\n".join(lines)


def memory_lines(plan: Plan) -> list[str]:
    """Per-GPU memory of each worker: the arithmetic `up` and `doctor` judge (memory.py)."""
    first = plan.memory[0]
    card = ("from the topology" if all(f.card_source == "topology" for f in plan.memory)
            else f"assumed RTX PRO 6000, {first.card_mib} MiB, where the topology has none")
    scales = ("fp32 as the pinned sm_120 path loads them" if first.scale_bytes == 4 else
              "e8m0 bytes as the moe switch repacks them at load time" if first.scale_bytes == 1 else
              f"{first.scale_bytes}-byte")
    out = [f"memory per GPU (arithmetic, not measured; card {card}; MoE scales {scales}):"]
    rows = []
    for f in plan.memory:
        ctx = f" = {f.kv_tokens / f.context_length:.1f} x ctx" if f.context_length and f.kv_gib > 0 else ""
        graphs = "-" if not f.graph_max_bs else (
            f"1-{f.graph_max_bs} req" + (f" ({f.graph_rows} verify rows)" if f.graph_rows != f.graph_max_bs else ""))
        rows.append((f.worker, f"TP{f.tp}", f"{f.card_mib * 2**20 / 2**30:.1f} GiB", f"{f.mem_fraction_static:.2f}",
                     f"{f.weights_gib:.1f} GiB", f"{f.mtp_gib:.1f} GiB" if f.mtp_gib else "-",
                     f"{f.kv_gib:.1f} GiB, {f.kv_tokens:,} tok{ctx}", f"{f.headroom_gib:.1f} GiB", graphs, f.status))
    out += format_table(("NAME", "TP", "CARD", "FRACTION", "WEIGHTS", "MTP LAYER", "KV POOL", "OUTSIDE POOL", "GRAPHS",
                         "CHECK"), rows)
    return out


def cluster_text(cfg: Config, parts: list[tuple[str, Plan]]) -> str:
    """Where every worker of a cluster runs, then each part's plan as that box's `up` builds it."""
    spec = cfg.cluster
    assert spec is not None
    lines = [f"cluster  {spec.boxes} box(es) x {len(spec.slot_gpus)} NUMA slots: {spec.prefill} prefill + "
             f"{spec.decode} decode TP workers, router on box 0; KV between boxes over UCX "
             f"{dict(cfg.env).get('UCX_TLS', '(UCX default transports)')}",
             f"hosts    {', '.join(spec.hosts) if spec.hosts else 'resolved at run time (shown as box-K)'}", ""]
    rows = [(str(w.box), w.advertise or f"box-{w.box}", w.name, ",".join(map(str, w.gpus)),
             f"http {w.port}" + (f", bootstrap {w.bootstrap_port}" if w.bootstrap_port is not None else "")
             + f", nccl {w.nccl_port}") for w in cfg.workers]
    lines += format_table(("BOX", "HOST", "WORKER", "GPUS", "PORTS"), rows)
    for name, plan in parts:
        lines += ["", f"===== {name}: `v4flash-pd up --cluster-plan FILE "
                      f"{'--role router' if name == 'router' else '--box ' + name.split()[-1]}`", plan_text(plan)]
    return "\n".join(lines)
