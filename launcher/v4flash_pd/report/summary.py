"""The report's README.md: a summary table at the top, then one table per section and the file list.

Numbers from a rehearsal are stand-ins (the stand-in engines and kernels), and every one of them
is marked so; a section that did not run says why instead of showing a number.
"""

from __future__ import annotations

from typing import Any

STANDIN = " *(stand-in)*"


def _f(x: Any, nd: int = 1) -> str:
    return "–" if not isinstance(x, (int, float)) or x != x else f"{x:,.{nd}f}"


def _level(bench: dict[str, Any] | None, c: int) -> dict[str, Any] | None:
    for level in (bench or {}).get("levels") or []:
        if isinstance(level, dict) and level.get("concurrency") == c:
            return level
    return None


def _gpu_line(facts: dict[str, Any]) -> str:
    gpus = facts.get("gpus") or []
    if not gpus:
        return "none found"
    names = sorted({f"{g.get('name')} (sm_{str(g.get('compute_cap', '')).replace('.', '')})" for g in gpus})
    source = str(facts.get("topology_source") or "")
    where = "" if not source or source.startswith("probe(") else f" (from {source}, not probed)"
    return f"{len(gpus)} x {', '.join(names)}, driver {facts.get('driver') or '?'}{where}"


def _numa_line(facts: dict[str, Any]) -> str:
    m = (facts.get("numa") or {}).get("gpus") or {}
    by: dict[Any, list[str]] = {}
    for g, n in sorted(m.items(), key=lambda kv: int(kv[0])):
        by.setdefault(n, []).append(g)
    return "; ".join(f"GPU {','.join(gs)} -> node {n if n != -1 else '?'}" for n, gs in by.items()) or "unknown"


def _stack_line(facts: dict[str, Any]) -> str:
    pk = (facts.get("fingerprint") or {}).get("packages") or {}
    keep = ("sglang", "sglang-kernel", "torch", "triton", "flashinfer-python", "nixl-cu13", "sglang-router", "v4flash-pd")
    return ", ".join(f"{k} {pk.get(k) or '–'}" for k in keep)


def _selfcheck_line(sc: dict[str, Any] | None) -> str:
    if not sc:
        return "not run"
    if sc.get("skipped"):
        return f"not run ({sc['skipped']})"
    return str(sc.get("headline", "?"))


def _eval_cell(ev: dict[str, Any] | None, mark: str) -> str:
    if not ev:
        return "–"
    if ev.get("error") and not ev.get("total"):
        return f"error: {ev['error']}"
    verdict = "pass" if ev.get("passed") else "FAIL"
    return f"{_f(ev.get('accuracy'), 3)} ({ev.get('correct')}/{ev.get('total')}, {verdict}){mark}"


def accept_cell(variant: dict[str, Any] | None, conc: list[int]) -> str:
    """The served accept length per concurrency level of a variant's bench (what the step model's cited
    range stands in for until it is measured on the box); 'off' where the trio did not speculate."""
    bench = (variant or {}).get("bench")
    cells = []
    for c in conc:
        a = (_level(bench, c) or {}).get("accept_length")
        if a is not None:
            cells.append(f"c={c}: {_f(a)}")
    if not cells:
        return "speculative decoding off (or no bench)"
    return ", ".join(cells) + (STANDIN if (variant or {}).get("standin") else "")


def markdown(rep: dict[str, Any]) -> str:
    facts = rep.get("facts") or {}
    sc = rep.get("selfcheck")
    step = rep.get("step") or {}
    e2e = rep.get("e2e") or []
    conc = rep.get("concurrency") or [1, 16, 64]
    out = [f"# v4flash-pd report: {rep.get('host')}, {rep.get('created')}", ""]
    if rep.get("standin"):
        out += ["> **REHEARSAL.** No model and no GPU were used: every number marked *(stand-in)* comes from the "
                "stand-in engines and kernels of `--rehearse` and says nothing about this box. The facts of the "
                "machine itself are real.", ""]
    on = next((v for v in e2e if v.get("name") == "on"), None)
    off = next((v for v in e2e if v.get("name") == "off"), None)

    def tok(v: dict[str, Any] | None, c: int) -> str:
        lv = _level((v or {}).get("bench"), c)
        mark = STANDIN if (v or {}).get("standin") else ""
        return f"{_f(lv.get('output_tok_s'))}{mark}" if lv else "–"

    out += ["## Summary", "", "| | |", "|---|---|",
            f"| GPUs | {_gpu_line(facts)} |",
            f"| P2P read / write | {facts.get('p2p_read_summary', 'unknown')} / "
            f"{facts.get('p2p_write_summary', 'unknown')} |",
            f"| NUMA | {_numa_line(facts)} |",
            f"| stack | {_stack_line(facts)} |",
            f"| kernel self-check | {_selfcheck_line(sc)} |"]
    comp = (step.get("compositions") or [])
    if comp:
        c0 = comp[0]
        out.append(f"| one step, {c0.get('spec')} | upstream {_f(c0.get('upstream_ms'))} ms, ours "
                   f"{_f(c0.get('patched_ms'))} ms |")
    else:
        out.append(f"| step bench | {step.get('why') or step.get('status') or 'not run'} |")
    if e2e:
        out.append(f"| end to end, c={conc[0]}, output tok/s | patches on {tok(on, conc[0])}, all off {tok(off, conc[0])} |")
        out.append(f"| accuracy gate | patches on {_eval_cell((on or {}).get('eval'), _mark(on))}, all off "
                   f"{_eval_cell((off or {}).get('eval'), _mark(off))} |")
        out.append(f"| MTP accept length (measured: tokens per verify) | {accept_cell(on, conc)} |")
    else:
        out.append(f"| end to end | {rep.get('e2e_skipped') or 'not run'} |")
    failures = rep.get("failures") or []
    if failures:
        out.append(f"| problems | {'; '.join(failures)} |")
    out.append("")

    if e2e:
        head = (["variant", "patches"] + [f"c={c} tok/s" for c in conc]
                + [f"TTFT p50 ms (c={conc[0]})", f"ITL p50 ms (c={conc[0]})", "eval"])
        out += ["## End to end through the router (A/B per patch)", "",
                "Output tokens/s per concurrency level, `v4flash-pd bench` with each configuration's own trio; "
                "`eval` is the accuracy gate.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for v in e2e:
            mark = STANDIN if v.get("standin") else ""
            if v.get("status") != "ok" and not v.get("bench"):
                out.append(f"| {v['name']} | {_switches(v)} | " + " | ".join("–" for _ in conc)
                           + f" | – | – | failed: {v.get('error')} |")
                continue
            first = _level(v.get("bench"), conc[0]) or {}
            ttft = _f((first.get("ttft_ms") or {}).get("p50"))
            itl = _f((first.get("itl_ms") or {}).get("p50"))
            out.append(f"| {v['name']} | {_switches(v)} | " + " | ".join(tok(v, c) for c in conc)
                       + f" | {ttft}{mark} | {itl}{mark} | {_eval_cell(v.get('eval'), mark)} |")
        out.append("")

    out += [f"## One decode step on GPU {step.get('gpu', '?')} (`bench --step`): upstream vs ours", ""]
    if comp:
        out += ["| step | upstream ms | ours ms | upstream tok/s | ours tok/s |", "|---|---|---|---|---|"]
        for c in comp:
            out.append(f"| {c.get('spec')} | {_f(c.get('upstream_ms'))} | {_f(c.get('patched_ms'))} | "
                       f"{_f(c.get('upstream_tok_s'))} | {_f(c.get('patched_tok_s'))} |")
    else:
        out.append(f"Not measured: {step.get('why') or step.get('status') or 'not run'} (log: `step/step.log`).")
    out.append("")

    out += ["## Kernel self-check", ""]
    if sc and sc.get("patches"):
        out += [sc.get("headline", ""), "", "| patch | result | detail |", "|---|---|---|"]
        for name, p in sc["patches"].items():
            failed = p.get("status") == "fail"
            detail = f"{p.get('class')} on {p.get('where')}: {p.get('error')}" if failed else (p.get("error") or "")
            out.append(f"| {name} | {p.get('status')} | {detail} |")
    else:
        out.append(_selfcheck_line(sc))
    out += ["", "## Files", "",
            "- `report.json`: everything above, machine-readable (schema `v4flash-pd.report/1`)",
            "- `fingerprint/`: fingerprint and stack versions, topology, `nvidia-smi -q`, `topo -m`, `topo -p2p r|w`, "
            "`numactl -H`, `lscpu`, `uname -a`, `doctor --json`, the plan (secrets redacted)",
            "- `selfcheck.json`, `selfcheck/`: the kernel self-check per GPU and patch, with each GPU's log",
            "- `step/`: the step bench's output (`step.json`, `step.md`, `step.log`)",
            "- `e2e/<variant>/`: `bench.json`, `eval.json`, the launcher's output and the trio's run dir", ""]
    if rep.get("scrubbed"):
        out += [f"Secrets were found and replaced by `<redacted>` in: {', '.join(rep['scrubbed'])}.", ""]
    return "\n".join(out)


def _mark(v: dict[str, Any] | None) -> str:
    return STANDIN if (v or {}).get("standin") else ""


def _switches(v: dict[str, Any]) -> str:
    sw = v.get("switches") or {}
    off = [n for n, on in sw.items() if not on]
    return "all on" if not off else "all off" if len(off) == len(sw) else "off: " + ", ".join(off)
