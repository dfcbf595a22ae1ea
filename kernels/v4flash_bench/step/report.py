"""Text and markdown for the step plan (`--dry-run`) and for measured compositions (pure formatting)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence, Tuple

from v4flash_bench.step import model as M
from v4flash_kernels.kit.table import table


def _f(x: float, nd: int = 2) -> str:
    return "-" if x != x else f"{x:.{nd}f}"


def _sig(x: float) -> str:
    """About three significant digits without exponents (tiny floors stay readable)."""
    if x != x:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _shape(op: M.Op) -> str:
    p = {k: v for k, v in op.params if k not in ("variant", "path")}
    return " ".join(f"{k}={v}" for k, v in p.items())


def plan_text(specs: Sequence[M.StepSpec]) -> str:
    """Every op of every composition with its shape, calls per step and floors (no GPU needed)."""
    lines = [f"layers: {M.layer_counts()} (compress_ratios {list(M.COMPRESS_RATIOS)})",
             f"floor machine: {M.RTX6000.name}, {M.RTX6000.bw / 1e12:.3f} TB/s, "
             f"{M.RTX6000.bf16_flops / 1e12:.1f} bf16 / {M.RTX6000.fp8_flops / 1e12:.1f} fp8 TFLOP/s"]
    for s in specs:
        ops = M.step_ops(s)
        lines.append("")
        lines.append(f"== {s.label}  (heads: upstream {s.heads_upstream}, patched {s.heads_patched})")
        lines.append(f"{'op':44s} {'path':8s} {'calls':>5s} {'MB/call':>9s} {'GFLOP':>8s} {'floor6K us':>10s}  shape")
        for op in ops:
            path = op.p.get("variant", op.p.get("path", "both"))
            lines.append(f"{op.name:44s} {path:8s} {op.count:5d} {op.bytes / 1e6:9.2f} {op.flops / 1e9:8.3f} "
                         f"{op.floor_us(M.RTX6000):10.2f}  {_shape(op)}")
        for path in ("upstream", "patched"):
            fl = sum(o.floor_us(M.RTX6000) * o.count for o in M.ops_for_path(ops, path)) / 1e3
            lines.append(f"floor of the timed ops, {path} path: {fl:.2f} ms on one RTX PRO 6000")
        for e in M.estimates(s.phase, s.batch, s.tp):
            lines.append(f"estimate: {e.name}: {e.count} x {e.us_per_call:.1f} us = "
                         f"{e.count * e.us_per_call / 1e3:.2f} ms ({e.source})")
    uniq = M.unique_ops(specs)
    lines.append("")
    lines.append(f"distinct shapes to time: {len(uniq)}")
    return "\n".join(lines)


def _per_op_rows(up: M.Composition, pa: M.Composition) -> List[Tuple[Any, ...]]:
    """(upstream line, patched line) of each op by name (attention differs by key); None where one
    path has no such op (the fused mHC boundary is patched only), placed after its patched neighbour."""
    up_by = {ln.name: ln for ln in up.lines}
    pa_by = {ln.name: ln for ln in pa.lines}
    names = [ln.name for ln in up.lines]
    prev = ""
    for ln in pa.lines:
        if ln.name not in up_by:
            names.insert(names.index(prev) + 1 if prev in names else len(names), ln.name)
        prev = ln.name
    return [(up_by.get(n), pa_by.get(n)) for n in names]


def composition_table(up: M.Composition, pa: M.Composition, gpu: M.Machine, md: bool) -> str:
    s = up.spec
    unit = "s" if s.phase == "prefill" else "ms"
    div = 1e3 if s.phase == "prefill" else 1.0
    head = ["op", "calls (upstream / patched)", "upstream µs", "patched µs", f"upstream {unit}", f"patched {unit}",
            f"patched RTX 6000 {unit}", f"floor 6K {unit}", f"floor {gpu.name.split()[-1]} {unit}", "patched/floor",
            "patched source"]
    body = []
    for ln, p in _per_op_rows(up, pa):
        one = ln if ln is not None else p
        name = one.name + (" (estimate)" if any(x is not None and x.estimated for x in (ln, p)) else "")
        calls = str(one.count) if ln is None or p is None or ln.count == p.count else f"{ln.count} / {p.count}"
        us_up, ms_up = (_sig(ln.us_call), _sig(ln.ms_step / div)) if ln is not None else ("-", "-")
        if ln is not None and ln.failed:
            us_up, ms_up = "FAILED", "FAILED"
        if p is None:
            body.append([name, calls, us_up, "-", ms_up, "-", "-", "-", "-", "-", "(upstream path only)"])
            continue
        ratio = p.ms_step / p.floor_gpu_ms if p.floor_gpu_ms > 0 else float("nan")
        if p.failed:
            body.append([name, calls, us_up, "FAILED", ms_up, "FAILED", "-", _sig(p.floor_rtx_ms / div),
                         _sig(p.floor_gpu_ms / div), "-", p.source])
            continue
        body.append([name, calls, us_up, _sig(p.us_call), ms_up, _sig(p.ms_step / div),
                     _range(p.rtx_lo_ms / div, p.rtx_hi_ms / div), _sig(p.floor_rtx_ms / div),
                     _sig(p.floor_gpu_ms / div), _sig(ratio) + "x", p.source])
    t_lo = sum(ln.rtx_lo_ms for ln in pa.lines if not ln.estimated)
    t_hi = sum(ln.rtx_hi_ms for ln in pa.lines if not ln.estimated)
    body.append(["**timed ops**" if md else "timed ops", "", "", "", _sig(up.timed_ms / div), _sig(pa.timed_ms / div),
                 _range(t_lo / div, t_hi / div), _sig(pa.floor_rtx_ms / div), _sig(pa.floor_gpu_ms / div),
                 _sig(pa.timed_ms / pa.floor_gpu_ms) + "x", ""])
    for e in up.estimates:
        v = e.count * e.us_per_call / 1e3 / div
        body.append([f"{e.name} (estimate)", str(e.count), _sig(e.us_per_call), _sig(e.us_per_call), _sig(v),
                     _sig(v), _sig(v), "", "", "", e.source])
    tot = "**total**" if md else "total"
    lo, hi = pa.rtx_range_ms
    body.append([tot, "", "", "", _total(up, up.total_ms / div), _total(pa, pa.total_ms / div),
                 _range(lo / div, hi / div), "", "", "", ""])
    if s.phase == "prefill":
        body.append(["TTFT of this chunk (s)", "", "", "", _f(up.total_ms / 1e3, 3), _f(pa.total_ms / 1e3, 3),
                     f"{_f(lo / 1e3, 3)} - {_f(hi / 1e3, 3)}", "", "", "", ""])
    elif s.phase == "verify":
        acc = M.accept_range(s.k)
        cells = [_f(M.spec_tok_s(c.total_ms, s.batch, acc.mid, s.k)[1], 1) for c in (up, pa)]
        rng = [M.spec_tok_s(x, s.batch, a, s.k)[1] for x, a in ((hi, acc.low), (lo, acc.high))]
        body.append([f"tok/s (aggregate) at the cited accept length {acc.mid:.2f} ({acc.low}-{acc.high})", "", "",
                     "", cells[0], cells[1], f"{_f(rng[0], 0)} - {_f(rng[1], 0)}", "", "", "", ""])
    else:
        t_lo, t_hi = pa.rtx_tok_s_range()
        body.append(["tok/s (aggregate, this GPU's TP group)", "", "", "", _f(up.tok_s(), 1), _f(pa.tok_s(), 1),
                     f"{_f(t_lo, 0)} - {_f(t_hi, 0)}", "", "", "", ""])
    return table(head, body, md)


def _total(c: M.Composition, value: float, nd: int | None = None) -> str:
    """A total of a step, or "incomplete" when an op of it failed its check (no time replaces it)."""
    if c.failed:
        return "incomplete (FAILED: " + ", ".join(c.failed) + ")"
    return _sig(value) if nd is None else _f(value, nd)


def _range(lo: float, hi: float) -> str:
    return f"{_sig(lo)} - {_sig(hi)}"


def summary_table(pairs: Iterable[Tuple[M.Composition, M.Composition]], md: bool,
                  kernels: Dict[Tuple[str, str], float] | None = None) -> str:
    kernels = kernels or {}
    head = ["step", "upstream ms", "patched ms", "speed-up", "upstream tok/s", "patched tok/s",
            "patched on RTX 6000: ms / tok/s (range)", "timed ops: upstream / patched / floor 6K ms", "estimates ms",
            "kernels per step: upstream / patched"]
    body = []
    for up, pa in pairs:
        s = up.spec
        dec = s.phase == "decode"  # a verify cycle's tok/s depends on the accept length: see spec_table
        tps_u = up.tok_s() if dec else float("nan")
        tps_p = pa.tok_s() if dec else float("nan")
        lo, hi = pa.rtx_range_ms
        t_lo, t_hi = pa.rtx_tok_s_range()
        rtx = f"{_f(lo, 1)} - {_f(hi, 1)}" + (f" / {_f(t_lo, 0)} - {_f(t_hi, 0)}" if dec else "")
        body.append([s.label, _total(up, up.total_ms, 1), _total(pa, pa.total_ms, 1),
                     _f(up.total_ms / pa.total_ms, 2) + "x",
                     _f(tps_u, 1), _f(tps_p, 1), rtx,
                     f"{_f(up.timed_ms, 1)} / {_f(pa.timed_ms, 1)} / {_f(pa.floor_rtx_ms, 2)}", _f(up.estimate_ms, 1),
                     f"{_f(kernels.get((s.label, 'upstream'), float('nan')), 0)} / "
                     f"{_f(kernels.get((s.label, 'patched'), float('nan')), 0)}"])
    return table(head, body, md)


def tp_table(pairs: Iterable[Tuple[M.Composition, M.Composition]], md: bool) -> str:
    """The same 4 GPUs serving S streams as one TP4 decode worker (B = S) or as two TP2 workers (B = S/2
    each): per-GPU and per-stream tok/s (patched path; H200 figures, then the RTX PRO 6000 range). Only
    rows whose streams fit both layouts' KV pools (`model.streams_fit`: the TP2 pool holds 32 8K-token
    streams per worker). Empty when the run holds no such pair."""
    by = {(pa.spec.tp, pa.spec.batch, pa.spec.configured_ctx, pa.spec.actual_ctx): pa
          for _up, pa in pairs if pa.spec.phase == "decode"}
    head = ["streams on 4 GPUs", "context", "TP4 step ms (B=S)", "TP4 tok/s per GPU", "TP2 step ms (B=S/2)",
            "2x TP2 tok/s per GPU", "2x TP2 / TP4", "per stream tok/s TP4 / TP2", "RTX 6000 tok/s per GPU: TP4 | 2x TP2"]
    body = []
    for (tp, b, c, a), p4 in by.items():
        if tp != 4 or b % 2:
            continue
        p2 = by.get((2, b // 2, c, a))
        if p2 is None or not (M.streams_fit(4, b) and M.streams_fit(2, b // 2)):
            continue
        g4, g2 = p4.tok_s() / 4, 2 * p2.tok_s() / 4
        r4 = [x / 4 for x in p4.rtx_tok_s_range()]
        r2 = [2 * x / 4 for x in p2.rtx_tok_s_range()]
        body.append([str(b), f"{M.fmt_ctx(c)} L={M.fmt_ctx(a)}", _f(p4.total_ms, 1), _f(g4, 1), _f(p2.total_ms, 1),
                     _f(g2, 1), _f(g2 / g4, 2) + "x", f"{_f(1e3 / p4.total_ms, 1)} / {_f(1e3 / p2.total_ms, 1)}",
                     f"{_f(r4[0], 0)} - {_f(r4[1], 0)} | {_f(r2[0], 0)} - {_f(r2[1], 0)}"])
    return table(head, body, md) if body else ""


def spec_table(pairs: Iterable[Tuple[M.Composition, M.Composition]], md: bool) -> str:
    """Speculative decoding per (B, k): the verify cycle (target forward over B x (k+1) rows + k draft
    forwards + their all-reduces) next to the plain step of the same B and context, and tok/s per
    stream / aggregate at the cited accept-length range of k draft steps (`model.ACCEPT`: low, mid,
    high; patched path, H200). Empty when the run holds no verify composition."""
    plain = {(pa.spec.tp, pa.spec.batch, pa.spec.configured_ctx, pa.spec.actual_ctx): pa
             for _up, pa in pairs if pa.spec.phase == "decode"}
    head = ["B", "k", "plain step ms", "cycle ms (verify + drafts)", "cycle / plain", "plain tok/s per stream / agg.",
            "accept length low / mid / high (cited)"]
    head += [f"{w}: tok/s per stream / agg. (x plain)" for w in ("low", "mid", "high")]
    body = []
    for _up, pa in pairs:
        s = pa.spec
        if s.phase != "verify":
            continue
        base = plain.get((s.tp, s.batch, s.configured_ctx, s.actual_ctx))
        p_ms = base.total_ms if base is not None else float("nan")
        acc = M.accept_range(s.k)
        row = [str(s.batch), str(s.k), _f(p_ms, 2), _f(pa.total_ms, 2), _f(pa.total_ms / p_ms, 2) + "x",
               f"{_f(1e3 / p_ms, 1)} / {_f(s.batch * 1e3 / p_ms, 0)}",
               f"{acc.low:.2f} / {acc.mid:.2f} / {acc.high:.2f}"]
        for _w, a in acc.points():
            per, agg = M.spec_tok_s(pa.total_ms, s.batch, a, s.k)
            row.append("-" if per != per else f"{_f(per, 1)} / {_f(agg, 0)} ({_f(per * p_ms / 1e3, 2)}x)")
        body.append(row)
    return table(head, body, md) if body else ""


def step_graph_table(graphs: Sequence[Any], pairs: Iterable[Tuple[M.Composition, M.Composition]],
                     kernels: Dict[Tuple[str, str], float], md: bool) -> str:
    """The step as one CUDA graph (`stepgraph`) next to the sum of its ops timed alone, and its kernel
    count: the graph's kernel nodes, and calls x kernels per call from the per-op captures."""
    sums = {(c.spec.label, c.path): c.timed_ms for up, pa in pairs for c in (up, pa)}
    head = ["step", "path", "per-op sum (timed) ms", "whole step in one graph ms", "graph / sum", "kernels in the graph",
            "kernels per step (per-op)", "note"]
    body = []
    for g in graphs:
        label, path = g.spec, g.path
        ms, summed = g.ms, sums.get((label, path), float("nan"))
        body.append([label, path, _f(summed, 2), _f(ms, 2), _f(ms / summed, 2) + "x" if ms == ms else "-",
                     str(g.kernels or "-"), _f(kernels.get((label, path), float("nan")), 0),
                     g.error or ""])
    return table(head, body, md) if body else ""
