"""Benchmark of the MXFP4 MoE: ours v1 (drop-in) vs ours v2 (repacked experts) vs upstream.

    python -m v4flash_bench.moe [--json out.json] [--md out.md] [--sizes 1,2,...] [--tp 4]
                                        [--no-adversarial] [--no-upstream] [--copies 4] [--prewarm 16]
    python -m v4flash_bench.moe --quick [--quick-sizes 1,16,64,256,1024] [--json sweep.json]
    python -m v4flash_bench.moe --prefill [--prefill-sizes 256,1024,4096] [--json prefill.json]

Per TP (DeepSeek-V4-Flash routed experts per GPU: E=256, top-6, hidden 4096, intermediate 512 at
TP4 / 1024 at TP2 / 2048 at TP1) it draws `--copies` independent sets of expert weights once (int8
nibbles and fp32 power-of-two scales, as SGLang's sm_120 loader leaves them; each ~1 GB at TP4,
together far past the 60 MB L2) and their repacked form (`repack.repack_experts`: the same bytes,
uint8 e8m0 scales). Per shape it draws routings and activations, checks every variant against the
fp64 reference (all tokens, or 48 random ones for big M) with NaN-poisoned outputs, then times it:
decode sizes (M <= 64) as one CUDA graph holding one call per weight copy (consecutive calls stream
different weights, as consecutive layers do) replayed under `triton.testing.do_bench` (L2 flushed
before each replay, median / copies); larger sizes the same way without a graph. Upstream from
M=256 on is timed with one call (~40-620 ms each).

Variants: `v1` = `op.mxfp4_moe_forward` on the loader's fp32 scales (what the `moe` patch runs
without the repack), `v2` = `repacked_op.moe_forward_repacked` on the repacked experts (what a repacked
layer runs), `upstream` = the pinned `mxfp4_moe_forward_triton` from the sglang wheel.

`--quick` instead sweeps candidate v2 plans (one GEMM varied at a time around the planner's) and,
from M=256 on, v1's plan on the fast scales, with a per-kernel device-time breakdown (torch
profiler), to pick the planner's table in one GPU round.

`--prefill` times the repacked experts' prefill path against the bar it must clear, v1 (the
drop-in on the loader's order and fp32 scales), at M = 256, 1024, 4096 (~1 min with compiles):
the planner's plan, v1's row-block GEMM on the PAIR_SPLIT words with one GEMM varied at a time
(neighbouring tiles x both operand orders), the v2 plans up to M=1024 (the v2/v1 crossover), and
v1's tiles on the loader's order with the fast scales (the path before PAIR_SPLIT). It prints each
size's variants fastest first and a verdict line (planner vs v1; exit status 1 if any check fails).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Tuple

from v4flash_kernels.kit.measure import time_graph
from v4flash_kernels.provenance import measured_commit

BW_H200 = 4.3e12  # measured D2D copy bandwidth (bytes/s)
BW_RTX6000 = 1.792e12  # GDDR7 datasheet
REL_TOL = 1e-2
REF_TOKENS = 48  # fp64 check on this many random tokens when M is larger
GRAPH_MAX_M = 64  # decode sizes: timed as CUDA-graph replays
UPSTREAM_ONE_CALL_M = 256  # from here upstream is timed with one call
UPSTREAM_SKIP_FLOPS = 1.2e12  # skip upstream above this many FLOPs per call (~2.4 s on H200)
EXPERTS, TOPK, HIDDEN = 256, 6, 4096
INTER = {1: 2048, 2: 1024, 4: 512, 8: 256}  # routed-expert intermediate size per GPU at each TP
CLAMP, SCALING = 10.0, 1.5
DEFAULT_SIZES = "1,2,4,8,16,32,64,256,1024,4096"
QUICK_SIZES = "1,16,64,256,1024"
PREFILL_SIZES = "256,1024,4096"
V1_BASELINE = "v1 (drop-in: loader order, fp32 scales)"
LOADER_FAST = "v1 tiles, loader order, fast scales (before PAIR_SPLIT)"
PLANNER = "repacked: planner"


@dataclass(frozen=True)
class Shape:
    tp: int
    tokens: int
    routing: str = "random"  # random | hot | dup
    hole_frac: float = 0.0


# ---------------------------------------------------------------- inputs


def build_weights(tp: int, copies: int, seed: int) -> List[Dict[str, Any]]:
    """`copies` expert sets on the GPU: the loader's tensors plus their repacked form."""
    import torch

    from v4flash_kernels.moe.repack import repack_experts

    inter = INTER[tp]
    gd = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(copies):
        def r(shape: Any, lo: Any, hi: Any) -> Any:
            return torch.randint(lo, hi, shape, dtype=torch.uint8, device="cuda", generator=gd)

        w13, w2 = r((EXPERTS, 2 * inter, HIDDEN // 2), 0, 256), r((EXPERTS, HIDDEN, inter // 2), 0, 256)
        s13 = r((EXPERTS, 2 * inter, HIDDEN // 32), 118, 123).view(torch.float8_e8m0fnu).to(torch.float32)
        s2 = r((EXPERTS, HIDDEN, inter // 32), 118, 123).view(torch.float8_e8m0fnu).to(torch.float32)
        w13, w2 = w13.view(torch.int8), w2.view(torch.int8)
        out.append({"w13_packed": w13, "w2_packed": w2, "w13_scale": s13, "w2_scale": s2,
                    "experts": repack_experts(w13, w2, s13, s2)})
    return out


def build_calls(shape: Shape, weights: List[Dict[str, Any]], seed: int) -> List[Dict[str, Any]]:
    """One call's arguments per weight copy (upstream's keywords, plus the repacked experts)."""
    import torch

    from v4flash_kernels.moe.reference import MoeCase, make_routing

    case = MoeCase(tokens=shape.tokens, experts=EXPERTS, topk=TOPK, hidden=HIDDEN, inter=INTER[shape.tp],
                   routing=shape.routing, hole_frac=shape.hole_frac, clamp_limit=CLAMP, routed_scaling_factor=SCALING)
    g = torch.Generator().manual_seed(seed)
    calls = []
    for w in weights:
        ids, tw = make_routing(case, g, "cuda")
        x = torch.randn((shape.tokens, HIDDEN), generator=g).to(torch.bfloat16).cuda()
        calls.append(dict(w, hidden_states=x, topk_ids=ids, topk_weights=tw, hidden_size=HIDDEN,
                          intermediate_size=INTER[shape.tp], routed_scaling_factor=SCALING, clamp_limit=CLAMP))
    return calls


def upstream_kwargs(kw: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in kw.items() if k != "experts"}


# ---------------------------------------------------------------- variants


def v1_fn(plan: Any = None) -> Callable[..., Any]:
    """`fn(out=None, **call)` running v1 (the drop-in) on the loader's fp32 scales."""
    from v4flash_kernels.moe import op as v1

    def call(out: Any = None, **kw: Any) -> Any:
        return v1.run(kw["hidden_states"], kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"],
                      kw["topk_ids"], kw["topk_weights"], kw["intermediate_size"], kw["routed_scaling_factor"],
                      kw["clamp_limit"], plan=plan, out=out)
    return call


def v2_fn(plan: Any = None) -> Callable[..., Any]:
    """`fn(out=None, **call)` running the repacked-experts forward (planner's plan, or `plan`)."""
    from v4flash_kernels.moe import repacked_op

    def call(out: Any = None, **kw: Any) -> Any:
        return repacked_op.run_repacked(kw["hidden_states"], kw["experts"], kw["topk_ids"], kw["topk_weights"],
                                  kw["routed_scaling_factor"], kw["clamp_limit"], plan=plan, out=out)
    return call


def upstream_fn(upstream: Any) -> Callable[..., Any]:
    def call(out: Any = None, **kw: Any) -> Any:
        return upstream.mxfp4_moe_forward_triton(**upstream_kwargs(kw))
    return call


def default_variants(shape: Shape, upstream: Any) -> Dict[str, Callable[..., Any]]:
    v = {"v1": v1_fn(), "v2": v2_fn()}
    if upstream is not None:
        v["upstream"] = upstream_fn(upstream)
    return v


def _mma(bt: Any, bn: Any, bk: Any, w: Any, s: Any, sk: int = 1) -> Any:
    from v4flash_kernels.moe.repacked_op import MmaConfig

    return MmaConfig(bt, bn, bk, w, s, sk)


def v2_candidates(shape: Shape) -> Dict[str, Any]:
    """Plans to sweep at this size: one GEMM varied at a time around the planner's plan."""
    from v4flash_kernels.moe import op as v1
    from v4flash_kernels.moe import repacked_op

    inter = INTER[shape.tp]
    base = repacked_op.make_plan(shape.tokens, TOPK, EXPERTS, HIDDEN, inter)
    plans: List[Any] = [base]
    if isinstance(base, repacked_op.PlanV2):
        t = base.gemm1.block_t
        g1s = [_mma(t, 64, 256, 4, 3), _mma(t, 64, 128, 4, 4), _mma(t, 64, 512, 4, 2), _mma(t, 32, 256, 2, 4),
               _mma(t, 128, 256, 8, 3), _mma(t, 64, 256, 4, 4)]
        g2s = [_mma(t, 64, 256, 4, 3), _mma(t, 64, 128, 4, 4), _mma(t, 32, 256, 2, 3), _mma(t, 128, 256, 8, 3),
               _mma(t, 128, 128, 4, 3)]
        if base.inline and shape.tokens <= 8:
            g1s += [_mma(8, 64, 256, 4, 3, 2), _mma(8, 64, 256, 4, 3, 4), _mma(8, 32, 256, 2, 4, 4),
                    _mma(8, 64, 128, 4, 4, 4), _mma(8, 64, 256, 4, 3, 8)]
        else:
            other = 16 if t == 8 else 8
            g1s += [_mma(other, 64, 256, 4, 3)]
            g2s += [_mma(other, 64, 256, 4, 3)]
            if shape.tokens >= 256:
                g1s += [_mma(32, 64, 256, 4, 3)]
                g2s += [_mma(32, 64, 256, 4, 3)]
        plans += [repacked_op.PlanV2(base.inline, g, base.gemm2) for g in g1s]
        plans += [repacked_op.PlanV2(base.inline, base.gemm1, g) for g in g2s]
        if not base.inline and shape.tokens >= 128:
            plans.append(v1.make_plan(shape.tokens, TOPK, EXPERTS, HIDDEN, inter))  # v1 tiles, fast scales
    else:  # a v1 plan (fast scales): the v2 tiles with the most tokens per MMA against it
        for t in (16, 32):
            plans.append(repacked_op.PlanV2(False, _mma(t, 64, 256, 4, 3), _mma(t, 64, 256, 4, 3)))
    out: Dict[str, Any] = {}
    for p in plans:
        out.setdefault(p.name, p)
    return out


def v1_fast_loader_order_fn(plan: Any) -> Callable[..., Any]:
    """v1's tiles on the loader's nibble order with the repacked (fast, uint8) scales: isolates what
    PAIR_SPLIT costs v1's prefill tiles (`nibbles=1` permutes the activation in registers)."""
    from v4flash_kernels.moe import op as v1

    def call(out: Any = None, **kw: Any) -> Any:
        ex = kw["experts"]
        return v1.run(kw["hidden_states"], kw["w13_packed"], kw["w2_packed"], ex.s13, ex.s2, kw["topk_ids"],
                      kw["topk_weights"], kw["intermediate_size"], kw["routed_scaling_factor"], kw["clamp_limit"],
                      plan=plan, out=out, fast_scales=True, nibbles=0)
    return call


def sweep_variants(shape: Shape) -> Dict[str, Callable[..., Any]]:
    """The candidates as named variants: the planner's first, v1 tiles (on the fast scales) marked."""
    from v4flash_kernels.moe import op as v1

    plans = v2_candidates(shape)
    first = next(iter(plans))
    out = {("v2 (planner) " if name == first else "") + ("v1 tiles, fast scales " if isinstance(p, v1.Plan) else "")
           + name: v2_fn(p) for name, p in plans.items()}
    for name, p in plans.items():
        if isinstance(p, v1.Plan):
            out["v1 tiles, fast scales, loader order " + name] = v1_fast_loader_order_fn(p)
    return out


def prefill_candidates(shape: Shape) -> Dict[str, Any]:
    """Plans on the repacked experts at a prefill size, the planner's first: v1's row-block GEMM on the
    PAIR_SPLIT words around `repacked_op.prefill_plan` (GEMM1 tiles of half to twice its rows and a 4-warp
    128-row tile, GEMM2 tiles of 64 and 128 rows, each in both operand orders, the other GEMM kept),
    plus the v2 plans with 16- and 32-token tiles up to M=1024."""
    from dataclasses import replace

    from v4flash_kernels.moe import op as v1
    from v4flash_kernels.moe import repacked_op

    inter = INTER[shape.tp]
    base = repacked_op.make_plan(shape.tokens, TOPK, EXPERTS, HIDDEN, inter)
    pf = repacked_op.prefill_plan(shape.tokens, TOPK, EXPERTS, HIDDEN, inter)
    plans: List[Any] = [base, pf]
    bm = pf.gemm1.block_m
    g1s = [c for c in (repacked_op.PF_G1_SMALL, repacked_op.PF_G1, repacked_op.PF_G1_LARGE)
           if bm // 2 <= c.block_m <= 2 * bm]
    if bm >= 64:
        g1s.append(v1.GemmConfig(128, 32, 64, 4, 3, mode=1))  # 4 warps: several programs per SM
    g2s = [repacked_op.PF_G2, v1.GemmConfig(128, 64, 64, 8, 3, mode=1)]
    plans.append(v1.Plan(False, replace(pf.gemm1, mode=1 - pf.gemm1.mode), replace(pf.gemm2, mode=1 - pf.gemm2.mode)))
    for mode in (1, 0):
        plans += [v1.Plan(False, replace(g, mode=mode), pf.gemm2) for g in g1s]
        plans += [v1.Plan(False, pf.gemm1, replace(g, mode=mode)) for g in g2s]
    if shape.tokens <= 1024:
        plans += [repacked_op.PlanV2(False, _mma(t, 64, 256, 4, 3), _mma(t, 64, 256, 4, 3)) for t in (16, 32)]
    out: Dict[str, Any] = {}
    for p in plans:
        out.setdefault(p.name, p)
    return out


def prefill_variants(shape: Shape) -> Dict[str, Callable[..., Any]]:
    """The bar (v1 as the drop-in runs it), the planner's repacked path, the candidates on the
    repacked experts and v1's tiles on the loader's order with the fast scales."""
    from v4flash_kernels.moe import op as v1

    out: Dict[str, Callable[..., Any]] = {V1_BASELINE: v1_fn(), PLANNER: v2_fn()}
    for name, p in list(prefill_candidates(shape).items())[1:]:
        out["repacked: " + name] = v2_fn(p)
    out[LOADER_FAST] = v1_fast_loader_order_fn(v1.make_plan(shape.tokens, TOPK, EXPERTS, HIDDEN, INTER[shape.tp]))
    return out


def prefill_verdict(row: Dict[str, Any]) -> str:
    """One line per size: the planner's path against v1's, and the fastest repacked candidate."""
    v = row["variants"]
    base, plan = v[V1_BASELINE]["us"], v[PLANNER]["us"]
    cands = {k: x["us"] for k, x in v.items() if k.startswith("repacked: ") and x["ok"] and x["us"] == x["us"]}
    best = min(cands, key=cands.__getitem__)
    word = "OK" if plan <= base else "SLOWER"
    return (f"M={row['tokens']}: planner {plan:.1f} us vs v1 {base:.1f} us ({base / plan:.2f}x) {word}; "
            f"fastest repacked {cands[best]:.1f} us: {best[len('repacked: '):]}")


# ---------------------------------------------------------------- measurement


def check(fn: Callable[..., Any], kw: Dict[str, Any], ref: Any, tokens: Any, poison: bool) -> Dict[str, Any]:
    import torch

    from v4flash_kernels.kit.compare import rel_err

    extra = {"out": torch.full_like(kw["hidden_states"], float("nan"))} if poison else {}
    out = fn(**kw, **extra)
    torch.cuda.synchronize()
    nan = bool(torch.isnan(out).any())
    err = rel_err(out if tokens is None else out[tokens], ref)
    return {"ok": (not nan) and err <= REL_TOL, "rel_err": err, "nan": nan}


def time_calls(fn: Callable[..., Any], kws: List[Dict[str, Any]], graph: bool) -> float:
    """Median µs per call: one graph (or plain sequence) of one call per weight copy, L2 flushed."""
    import torch
    import triton

    def seq() -> None:
        for kw in kws:
            fn(**kw)
    if graph:
        return time_graph(seq) / len(kws)
    seq()  # compile outside the timing
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(seq, warmup=25, rep=100, return_mode="median")
    return float(ms) * 1e3 / len(kws)


def time_once(fn: Callable[..., Any], kw: Dict[str, Any]) -> float:
    """µs of one call (upstream at large M; its correctness call ran just before, so it is warm)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(**kw)
    b.record()
    torch.cuda.synchronize()
    return float(a.elapsed_time(b)) * 1e3


def kernel_breakdown(fn: Callable[..., Any], kws: List[Dict[str, Any]]) -> Dict[str, float]:
    """Mean device µs per call of each kernel (torch profiler, eager calls over the weight copies);
    the n-th GEMM launch of a call is GEMM1 (w13) or GEMM2 (w2)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for kw in kws:
        fn(**kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for kw in kws:
            fn(**kw)
        torch.cuda.synchronize()
    out: Dict[str, float] = {}
    try:
        from torch.profiler import DeviceType

        evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
        n_gemm = 0
        for e in evs:
            name = e.name[:60]
            if "gemm_kernel" in name:
                name = "gemm1 (w13)" if n_gemm % 2 == 0 else "gemm2 (w2)"
                n_gemm += 1
            out[name] = out.get(name, 0.0) + e.time_range.elapsed_us() / len(kws)
    except Exception:  # profiler API drift: totals per kernel name
        out = {}
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            if t:
                out[ev.key[:60]] = t / len(kws)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def shape_bytes(calls: List[Dict[str, Any]]) -> Tuple[float, float, float]:
    """(experts touched, bytes with fp32 scales, bytes with uint8 scales), mean over the copies:
    touched experts' weights and scales plus activations in and out."""
    from v4flash_kernels.moe.reference import touched_experts

    kw = calls[0]
    w = kw["w13_packed"][0].numel() + kw["w2_packed"][0].numel()
    s = kw["w13_scale"][0].numel() + kw["w2_scale"][0].numel()
    act = 2 * kw["hidden_states"].numel() * 2 + kw["topk_ids"].numel() * 8
    touched = sum(touched_experts(c["topk_ids"]) for c in calls) / len(calls)
    return touched, touched * (w + 4 * s) + act, touched * (w + s) + act


def run_shape(shape: Shape, weights: List[Dict[str, Any]], variants: Dict[str, Callable[..., Any]], seed: int,
              breakdown: bool = False) -> Dict[str, Any]:
    import torch

    from v4flash_kernels.moe.reference import flops, ref_of, subset_tokens

    calls = build_calls(shape, weights, seed)
    kw = calls[0]
    tokens = subset_tokens(shape.tokens, REF_TOKENS, torch.Generator().manual_seed(seed + 1), "cuda")
    ref = ref_of(upstream_kwargs(kw), tokens)
    touched, bytes_f32, bytes_u8 = shape_bytes(calls)
    fl = flops(kw)
    graph = shape.tokens <= GRAPH_MAX_M
    row = dict(asdict(shape), experts_touched=touched, bytes_fp32_scales=bytes_f32, bytes=bytes_u8, flops=fl,
               floor_h200_us=bytes_u8 / BW_H200 * 1e6, floor_rtx6000_us=bytes_u8 / BW_RTX6000 * 1e6,
               checked_tokens=shape.tokens if tokens is None else int(tokens.numel()), variants={})
    for name, fn in variants.items():
        if name == "upstream" and fl > UPSTREAM_SKIP_FLOPS:
            row["variants"][name] = {"ok": True, "rel_err": float("nan"), "nan": False, "us": float("nan"),
                                     "note": "skipped: > 2 s per call"}
            continue
        try:
            chk = check(fn, kw, ref, tokens, poison=name != "upstream")
            if name == "upstream" and shape.tokens >= UPSTREAM_ONE_CALL_M:
                us, note = time_once(fn, calls[1 % len(calls)]), "one call"
            else:
                us, note = time_calls(fn, calls, graph), ("graph" if graph else "eager")
        except Exception as exc:  # a swept config that does not launch must not end the run
            if name in ("v1", "v2", V1_BASELINE, PLANNER) or name.startswith("v2 (planner)"):
                raise
            chk, us, note = {"ok": False, "rel_err": float("nan"), "nan": False}, float("nan"), f"error: {exc}"[:300]
        row["variants"][name] = dict(chk, us=us, note=note)
        if breakdown and name != "upstream" and row["variants"][name]["ok"]:
            row["variants"][name]["breakdown_us"] = kernel_breakdown(fn, calls)
    del calls, kw, ref
    torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------- output


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'tp':>2} {'M':>5} {'routing':<8} {'exp':>4} {'floorH200':>9} {'floor6K':>8} {'v1':>8} {'v2':>8} "
            f"{'upstream':>10} {'v2/v1':>6} {'x_up':>6} {'err v2':>8}  plan v2")
    lines = [head, "-" * len(head)]
    for r in rows:
        v = r["variants"]
        v1, v2 = v.get("v1", {}).get("us", float("nan")), v.get("v2", {}).get("us", float("nan"))
        up = v.get("upstream", {}).get("us", float("nan"))
        rt = r["routing"] + (f"-{int(r['hole_frac'] * 100)}%" if r["hole_frac"] else "")
        bad = "" if all(x["ok"] for x in v.values()) else "  FAIL:" + ",".join(k for k, x in v.items() if not x["ok"])
        lines.append(
            f"{r['tp']:>2} {r['tokens']:>5} {rt:<8} {r['experts_touched']:>4.0f} {r['floor_h200_us']:>9.1f} "
            f"{r['floor_rtx6000_us']:>8.1f} {v1:>8.1f} {v2:>8.1f} {up:>10.1f} {v1 / v2:>6.2f} {up / v2:>6.1f} "
            f"{v.get('v2', {}).get('rel_err', float('nan')):>8.1e}  {r.get('plan_v2', '')}{bad}")
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    """The BENCH.md table: µs per layer call (median), the floors, v1 vs v2 vs upstream."""
    lines = [
        "| TP | M | routing | experts | floor H200 µs (u8 scales) | floor RTX 6000 µs | v1 µs | **v2 µs** | upstream µs "
        "| v2 vs v1 | v2 vs upstream | GB/s (v2) | rel. err v1 / v2 / upstream | plan v2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["variants"]
        us = {k: v.get(k, {}).get("us", float("nan")) for k in ("v1", "v2", "upstream")}
        err = " / ".join(f"{v.get(k, {}).get('rel_err', float('nan')):.1e}" for k in ("v1", "v2", "upstream"))
        note = v.get("upstream", {}).get("note", "")
        up = f"{us['upstream']:.0f}" + (f" ({note})" if note in ("one call",) or note.startswith("skip") else "")
        ok = "" if all(x["ok"] for x in v.values()) else " FAIL"
        rt = r["routing"] + (f", {int(r['hole_frac'] * 100)}% -1" if r["hole_frac"] else "")
        lines.append(
            f"| {r['tp']} | {r['tokens']} | {rt} | {r['experts_touched']:.0f} | {r['floor_h200_us']:.1f} | "
            f"{r['floor_rtx6000_us']:.1f} | {us['v1']:.1f} | **{us['v2']:.1f}** | {up} | {us['v1'] / us['v2']:.2f}x | "
            f"{us['upstream'] / us['v2']:.0f}x | {r['bytes'] / us['v2'] / 1e3:.0f} | {err}{ok} | {r.get('plan_v2', '')} |")
    return "\n".join(lines)


def default_shapes(tps: List[int], sizes: List[int], adversarial: bool) -> List[Shape]:
    shapes = [Shape(tp, m) for tp in tps for m in sizes]
    if adversarial and 4 in tps:
        shapes += [Shape(4, 64, "hot"), Shape(4, 16, "random", 0.25), Shape(4, 64, "dup"), Shape(4, 1024, "hot")]
    return shapes


# ---------------------------------------------------------------- compile up front


def _warm_worker(job: Any) -> int:
    """Compile (populate the on-disk Triton cache for) one variant at one shape, in a subprocess."""
    shape, quick, name = job
    import torch

    try:
        weights = build_weights(shape.tp, 1, 0)
        kw = build_calls(shape, weights, 0)[0]
        _variants(shape, quick, None)[name](**kw)
        torch.cuda.synchronize()
    except Exception as exc:  # reported again (and recorded) by the timing process
        print(f"prewarm: {name} at M={shape.tokens}: {exc}"[:300], file=sys.stderr)
        return 1
    return 0


def _variants(shape: Shape, quick: Any, upstream: Any) -> Dict[str, Callable[..., Any]]:
    """quick: False (the default table), True (`--quick`) or "prefill" (`--prefill`)."""
    if quick == "prefill":
        return prefill_variants(shape)
    return sweep_variants(shape) if quick else default_variants(shape, upstream)


def prewarm(shapes: List[Shape], quick: Any, procs: int) -> None:
    """Triton compiles one kernel at a time per process; spread the first compiles over processes
    (same GPU, same cache directory, so the timing process then finds every binary cached)."""
    import multiprocessing as mp

    from v4flash_kernels.moe import op as v1
    from v4flash_kernels.moe import repacked_op

    jobs, seen = [], set()
    for sh in shapes:
        names = _variants(sh, quick, None)
        v1_plan = v1.make_plan(sh.tokens, TOPK, EXPERTS, HIDDEN, INTER[sh.tp]).name
        v2_plan = repacked_op.make_plan(sh.tokens, TOPK, EXPERTS, HIDDEN, INTER[sh.tp]).name
        plans = {"v1": v1_plan, "v2": v2_plan, V1_BASELINE: v1_plan, PLANNER: v2_plan,
                 LOADER_FAST: "fast/" + v1_plan}
        for name in names:
            # one job per binary set: the plan, and for inline grouping the slot block (follows M)
            key = (sh.tp, plans.get(name, name), sh.tokens if sh.tokens * TOPK <= 16 else 0)
            if key not in seen:
                seen.add(key)
                jobs.append((sh, quick, name))
    import v4flash_bench.moe as importable  # picklable by name when run with -m

    with mp.get_context("spawn").Pool(max(1, min(procs, len(jobs)))) as pool:
        pool.map(importable._warm_worker, jobs, chunksize=1)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.moe", description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="4")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="tokens per call (M)")
    ap.add_argument("--no-adversarial", action="store_true", help="skip the hot / dup / -1 routings")
    ap.add_argument("--copies", type=int, default=4, help="weight copies rotated per timed call")
    ap.add_argument("--quick", action="store_true", help="sweep candidate v2 plans at a few sizes (TP4)")
    ap.add_argument("--quick-sizes", default=QUICK_SIZES)
    ap.add_argument("--prefill", action="store_true",
                    help="the repacked prefill path and its candidates against v1 (TP4, no upstream)")
    ap.add_argument("--prefill-sizes", default=PREFILL_SIZES)
    ap.add_argument("--breakdown", action="store_true", help="per-kernel device times (--prefill; --quick always)")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--prewarm", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes compiling kernels up front (0 = off)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("moe.bench needs a CUDA GPU", file=sys.stderr)
        return 2
    from v4flash_kernels.moe import op as v1
    from v4flash_kernels.moe import repacked_op

    def ints(s: str) -> List[int]:
        return [int(x) for x in s.split(",") if x]

    quick: Any = "prefill" if args.prefill else args.quick
    if args.prefill:
        shapes = [Shape(4, m) for m in ints(args.prefill_sizes)]
    elif args.quick:
        shapes = [Shape(4, m) for m in ints(args.quick_sizes)]
    else:
        shapes = default_shapes(ints(args.tp), ints(args.sizes), not args.no_adversarial)
    upstream = None
    if not args.no_upstream and not quick:
        from v4flash_kernels.upstream import MOE_PATH, load_module

        upstream = load_module(MOE_PATH)
    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    t0 = time.time()
    if args.prewarm:
        prewarm(shapes, quick, args.prewarm)
        print(f"[{time.time() - t0:6.1f}s] kernels compiled", flush=True)
    rows: List[Dict[str, Any]] = []
    weights: Dict[int, List[Dict[str, Any]]] = {}
    for i, sh in enumerate(shapes):
        if sh.tp not in weights:
            weights.clear()  # one TP's copies at a time (4 GB at TP4, 16 GB at TP1)
            torch.cuda.empty_cache()
            weights[sh.tp] = build_weights(sh.tp, args.copies, seed)
        variants = _variants(sh, quick, upstream)
        r = run_shape(sh, weights[sh.tp], variants, seed + 1 + i, breakdown=args.quick or args.breakdown)
        r["plan_v1"] = v1.make_plan(sh.tokens, TOPK, EXPERTS, HIDDEN, INTER[sh.tp]).name
        r["plan_v2"] = repacked_op.make_plan(sh.tokens, TOPK, EXPERTS, HIDDEN, INTER[sh.tp]).name
        rows.append(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": {"partial": True, "seed": seed}, "rows": rows}, f, indent=1)
        us = {k: x["us"] for k, x in r["variants"].items()}
        print(f"[{time.time() - t0:6.1f}s] tp{sh.tp} M={sh.tokens} {sh.routing}: "
              + " ".join(f"{k}={v:.1f}" for k, v in us.items()
                         if not quick or k.startswith("v2 (planner)") or k in (V1_BASELINE, PLANNER)),
              flush=True)
        if args.prefill:
            r["verdict"] = prefill_verdict(r)
            print("    " + r["verdict"], flush=True)
        if quick:
            for name, v in sorted(r["variants"].items(), key=lambda kv: kv[1]["us"]):
                parts = " ".join(f"{k.split(' ')[0]}={t:.1f}" for k, t in v.get("breakdown_us", {}).items())
                print(f"    {v['us']:9.1f} us  err {v['rel_err']:.1e} {'ok' if v['ok'] else 'FAIL'}  {name}  [{parts}]",
                      flush=True)
    props = torch.cuda.get_device_properties(0)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed, "seconds": round(time.time() - t0, 1),
            "upstream_origin": getattr(upstream, "__v4flash_origin__", None)}
    print(json.dumps(meta))
    if args.prefill:
        print("\n".join(r["verdict"] for r in rows))
    elif not args.quick:
        print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.md and not quick:
        with open(args.md, "w") as f:
            f.write(format_markdown(rows) + "\n")
    return 0 if all(x["ok"] for r in rows for x in r["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
