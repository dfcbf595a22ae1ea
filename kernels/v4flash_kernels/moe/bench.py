"""Benchmark of the grouped MXFP4 MoE: check against fp64, then time ours and upstream side by side.

    python -m v4flash_kernels.moe.bench [--json out.json] [--md out.md] [--tp 4,1] [--decode 1,2,...]
                                        [--prefill 256,...] [--quick] [--no-upstream]

Per shape (DeepSeek-V4-Flash routed experts per GPU: E=256, topk=6, hidden 4096, intermediate
512 at TP4 / 2048 at TP1) it draws `--copies` independent sets of expert weights (each ~1 GB at
TP4, together far past the 60 MB L2) and routings, checks ours (and every swept plan) and the
pinned upstream `mxfp4_moe_forward_triton` (loaded from the sglang wheel) against the fp64
reference (all tokens, or a random subset for big M) with NaN-poisoned outputs, then times each:
decode sizes as one CUDA graph holding one call per weight copy (so consecutive calls stream
different weights, as consecutive layers do), replayed under `triton.testing.do_bench` (L2
flushed before each replay, median / copies); prefill sizes the same way without a graph. Upstream
at huge M costs ~1 s per call, so it is timed with a single call there (or skipped, noted).

`--quick` instead sweeps the candidate GEMM configs (one GEMM varied at a time) and routing modes
at a few sizes and prints which wins, to pick the planner's table in one GPU round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List

from v4flash_kernels.attention.bench import variant_summary
from v4flash_kernels.provenance import measured_commit

BW_H200 = 4.3e12  # measured D2D copy bandwidth (bytes/s)
BW_RTX6000 = 1.792e12  # GDDR7 datasheet
REL_TOL = 1e-2
REF_TOKENS = 48  # fp64 check on this many random tokens when M is larger
UPSTREAM_ONE_CALL_M = 256  # from here upstream is timed with one call
UPSTREAM_SKIP_FLOPS = 1.2e12  # skip upstream above this many FLOPs per call (~2.4 s on H200)

TP = {4: 512, 1: 2048, 8: 256}  # intermediate size per GPU


@dataclass(frozen=True)
class Shape:
    tp: int
    tokens: int
    routing: str = "random"  # random | hot | dup
    hole_frac: float = 0.0


def _moe_case(shape: Shape):
    from v4flash_kernels.moe.reference import MoeCase

    return MoeCase(tokens=shape.tokens, experts=256, topk=6, hidden=4096, inter=TP[shape.tp],
                   routing=shape.routing, hole_frac=shape.hole_frac,
                   clamp_limit=10.0, routed_scaling_factor=1.5)


def build(shape: Shape, copies: int, seed: int) -> List[dict]:
    """`copies` call argument sets with distinct weights and routing, on the GPU."""
    import torch

    from v4flash_kernels.moe.reference import make_routing

    case = _moe_case(shape)
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(copies):
        w13 = torch.randint(0, 256, (256, 2 * case.inter, 2048), dtype=torch.uint8, device="cuda", generator=gd)
        w2 = torch.randint(0, 256, (256, 4096, case.inter // 2), dtype=torch.uint8, device="cuda", generator=gd)
        s13 = torch.randint(118, 123, (256, 2 * case.inter, 128), dtype=torch.uint8, device="cuda", generator=gd)
        s2 = torch.randint(118, 123, (256, 4096, case.inter // 32), dtype=torch.uint8, device="cuda", generator=gd)
        ids, w = make_routing(case, g, "cuda")
        x = torch.randn((case.tokens, 4096), generator=g).to(torch.bfloat16).cuda()
        out.append({
            "hidden_states": x, "w13_packed": w13.view(torch.int8), "w2_packed": w2.view(torch.int8),
            "w13_scale": s13.view(torch.float8_e8m0fnu).to(torch.float32),
            "w2_scale": s2.view(torch.float8_e8m0fnu).to(torch.float32),
            "topk_ids": ids, "topk_weights": w, "hidden_size": 4096, "intermediate_size": case.inter,
            "routed_scaling_factor": case.routed_scaling_factor, "clamp_limit": case.clamp_limit,
        })
    return out


def bind_plan(plan) -> Callable:
    """`fn(out=None, **upstream_kwargs)` running ours with an explicit plan."""
    from v4flash_kernels.moe import op as moe

    def call(out=None, **kw):
        return moe.run(kw["hidden_states"], kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"],
                       kw["topk_ids"], kw["topk_weights"], kw["intermediate_size"],
                       kw["routed_scaling_factor"], kw["clamp_limit"], plan=plan, out=out)
    return call


def check(fn: Callable, kw: dict, ref, tokens, poison: bool) -> dict:
    import torch

    from v4flash_kernels.moe.reference import rel_err

    extra = {}
    if poison:
        extra["out"] = torch.full_like(kw["hidden_states"], float("nan"))
    out = fn(**kw, **extra)
    torch.cuda.synchronize()
    nan = bool(torch.isnan(out).any())
    o = out if tokens is None else out[tokens]
    err = rel_err(o, ref)
    return {"ok": (not nan) and err <= REL_TOL, "rel_err": err, "nan": nan}


def time_calls(fn: Callable, kws: List[dict], graph: bool) -> float:
    """Median µs per call: one graph (or plain sequence) of one call per weight copy, L2 flushed."""
    import torch
    import triton

    def seq():
        for kw in kws:
            fn(**kw)
    seq()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            seq()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            seq()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")
        del g
    else:
        ms = triton.testing.do_bench(seq, warmup=25, rep=100, return_mode="median")
    return ms * 1e3 / len(kws)


def kernel_breakdown(fn: Callable, kws: List[dict]) -> Dict[str, float]:
    """Mean device µs per call of each kernel (torch profiler, eager calls over the weight copies)."""
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
    try:  # per launch, in order: the n-th gemm_kernel of a call is GEMM1 (w13) or GEMM2 (w2)
        from torch.autograd import DeviceType

        evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        n_gemm = 0
        for e in evs:
            name = e.name[:60]
            if name.startswith("gemm_kernel"):
                name = "gemm1 (w13)" if n_gemm % 2 == 0 else "gemm2 (w2)"
                n_gemm += 1
            out[name] = out.get(name, 0.0) + e.time_range.elapsed_us() / len(kws)
    except Exception:  # profiler API drift: fall back to totals per kernel name
        out = {}
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            if t:
                out[ev.key[:60]] = t / len(kws)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def time_once(fn: Callable, kw: dict) -> float:
    """µs of one call (for upstream at huge M; its correctness call ran just before, so it is warm)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(**kw)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3


def run_shape(shape: Shape, variants: Dict[str, Callable], upstream, copies: int, seed: int,
              breakdown: bool = False) -> dict:
    import torch

    from v4flash_kernels.moe.reference import floor_bytes, flops, ref_of, subset_tokens, touched_experts

    kws = kws_f32 = build(shape, copies, seed)
    kw = kws[0]
    g = torch.Generator().manual_seed(seed + 1)
    tokens = subset_tokens(shape.tokens, REF_TOKENS, g, "cuda")
    ref = ref_of(kw, tokens)
    touched = sum(touched_experts(k["topk_ids"]) for k in kws) / len(kws)
    nbytes = sum(floor_bytes(k, touched_experts(k["topk_ids"])) for k in kws) / len(kws)
    fl = flops(kw)
    graph = shape.tokens <= 64
    row = dict(asdict(shape), experts_touched=touched, bytes=nbytes, flops=fl,
               floor_h200_us=nbytes / BW_H200 * 1e6, floor_rtx6000_us=nbytes / BW_RTX6000 * 1e6,
               checked_tokens=shape.tokens if tokens is None else int(tokens.numel()), variants={})
    fns = dict(variants)
    if upstream is not None:
        fns["upstream"] = lambda out=None, **k: upstream.mxfp4_moe_forward_triton(**k)
    kws_u8 = [e8m0_scales(k) for k in kws] if any(n.startswith(E8M0) for n in fns) else None
    for name, fn in fns.items():
        if name.startswith(E8M0):
            kw, kws = kws_u8[0], kws_u8
        else:
            kw, kws = kws_f32[0], kws_f32
        if name == "upstream" and fl > UPSTREAM_SKIP_FLOPS:
            row["variants"][name] = {"ok": True, "rel_err": float("nan"), "nan": False, "us": float("nan"),
                                         "note": "skipped: > 2 s per call"}
            continue
        try:
            chk = check(fn, kw, ref, tokens, poison=name != "upstream")
            if name == "upstream" and shape.tokens >= UPSTREAM_ONE_CALL_M:
                us, note = time_once(fn, kws[1 % len(kws)]), "one call"
            else:
                us, note = time_calls(fn, kws, graph), ("graph" if graph else "eager")
        except Exception as exc:  # a swept config that does not launch must not end the run
            if name == "ours":
                raise
            chk, us, note = {"ok": False, "rel_err": float("nan"), "nan": False}, float("nan"), f"error: {exc}"[:300]
        row["variants"][name] = dict(chk, us=us, note=note)
        if breakdown and name != "upstream" and row["variants"][name]["ok"]:
            row["variants"][name]["breakdown_us"] = kernel_breakdown(fn, kws)
    del kws, kw, ref, kws_f32, kws_u8
    torch.cuda.empty_cache()
    return row


E8M0 = "e8m0 scales:"  # variant-name prefix: same kernel fed e8m0 bytes instead of fp32 scales


def e8m0_scales(kw: dict) -> dict:
    """The call's arguments with both scale tensors as e8m0 bytes (what a load-time repack would keep)."""
    import torch

    def u8(s):
        return ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)

    return dict(kw, w13_scale=u8(kw["w13_scale"]), w2_scale=u8(kw["w2_scale"]))


def default_variants(shape: Shape) -> Dict[str, Callable]:
    """Ours as the planner runs it, plus the same plan on e8m0 byte scales (25 % fewer bytes)."""
    from v4flash_kernels.moe import op as moe

    plan = moe.make_plan(shape.tokens, 6, 256, 4096, TP[shape.tp])
    return {"ours": bind_plan(plan), f"{E8M0} ours": bind_plan(plan)}


# ---------------------------------------------------------------- --quick: candidate sweep

# Candidates for --quick (block_m, block_n, block_k, warps, stages, mode); mode 0 = tl.dot(x, w^T),
# 1 = tl.dot(w, x^T), 2 = FMA. Decode sweeps whole plans (inline and sorted grouping); prefill varies
# one GEMM at a time around the planner's choice.
# Decode: whole plans, (inline?, gemm1, gemm2) with configs (block_m, block_n, block_k, warps,
# stages, mode, split_k).
_G1 = {"A": (16, 16, 256, 4, 3, 0, 1), "B": (16, 16, 256, 4, 3, 0, 2), "C": (16, 16, 256, 4, 3, 0, 4),
           "D": (16, 32, 256, 4, 3, 0, 4), "E": (16, 16, 256, 2, 3, 0, 4), "F": (1, 32, 256, 4, 1, 3, 4),
           "G": (16, 16, 128, 4, 4, 0, 8), "H": (16, 16, 512, 4, 3, 0, 1)}
_G2 = {"a": (16, 32, 128, 4, 3, 0), "b": (16, 16, 128, 4, 3, 0), "c": (16, 32, 128, 2, 3, 0), "d": (16, 64, 128, 4, 3, 0)}
DECODE_PLANS = tuple((True, _G1[g], _G2["a"]) for g in "ABCDEFGH") + tuple(
    (True, _G1["A"], _G2[x]) for x in "bcd") + tuple((False, _G1[g], _G2["a"]) for g in "ABCD") + tuple(
    (False, _G1["A"], _G2[x]) for x in "bc") + (
    # one stage: W bytes straight to registers (no cp.async round trip through shared memory)
    (False, (16, 16, 256, 4, 1, 0, 1), (16, 32, 128, 4, 1, 0)), (False, (16, 16, 256, 8, 1, 0, 1), (16, 32, 128, 8, 1, 0)),
    (True, (16, 16, 256, 4, 1, 0, 4), (16, 32, 128, 4, 1, 0)))
SWEEP_G1_PREFILL = ((32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 2),
                    (64, 64, 128, 4, 3), (128, 64, 64, 8, 3, 1))
SWEEP_G2_PREFILL = ((64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 32, 64, 4, 3), (32, 64, 128, 4, 3),
                    (64, 64, 64, 4, 4))


def sweep_variants(shape: Shape) -> Dict[str, Callable]:
    """Ours (the planner's plan) plus every candidate plan for this size."""
    from v4flash_kernels.moe import op as moe

    base = moe.make_plan(shape.tokens, 6, 256, 4096, TP[shape.tp])
    out = {"ours": bind_plan(base)}
    seen = {base}
    plans = []
    if base.gemm1.block_m <= 16:
        plans += [moe.Plan(inl, moe.GemmConfig(*a), moe.GemmConfig(*b)) for inl, a, b in DECODE_PLANS]
    else:
        plans += [replace(base, gemm1=moe.GemmConfig(*c)) for c in SWEEP_G1_PREFILL]
        plans += [replace(base, gemm2=moe.GemmConfig(*c)) for c in SWEEP_G2_PREFILL]
    for p in plans:
        if p not in seen:
            seen.add(p)
            out[p.name] = bind_plan(p)
    return out



def format_table(rows: List[dict]) -> str:
    head = (f"{'tp':>2} {'M':>5} {'routing':<8} {'exp':>5} {'floorH200':>9} {'floor6K':>8} {'ours':>9} "
            f"{'best':>9} {'upstream':>10} {'x_up':>7} {'TFLOP/s':>7} {'GB/s':>6} {'err':>8}  best variant")
    lines = [head, "-" * len(head)]
    for r in rows:
        ours, best_name, best, up, err, bad = variant_summary(r["variants"])
        rt = r["routing"] + (f"-{int(r['hole_frac'] * 100)}%" if r["hole_frac"] else "")
        lines.append(
            f"{r['tp']:>2} {r['tokens']:>5} {rt:<8} {r['experts_touched']:>5.0f} {r['floor_h200_us']:>9.1f} "
            f"{r['floor_rtx6000_us']:>8.1f} {ours:>9.1f} {best:>9.1f} {up:>10.1f} {up / ours:>7.1f} "
            f"{r['flops'] / ours / 1e6:>7.1f} {r['bytes'] / ours / 1e3:>6.0f} {err:>8.1e}  {best_name}{bad}"
        )
    return "\n".join(lines)


def format_markdown(rows: List[dict]) -> str:
    """The BENCH.md table: µs per layer call and the floors."""
    lines = [
        "| TP | M | routing | experts | floor H200 µs | floor RTX 6000 µs | **ours µs** | ours, e8m0 scales µs "
        "| upstream µs | ours vs upstream | TFLOP/s | GB/s | rel. err | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["variants"]
        ours = v["ours"]
        upv = v.get("upstream", {})
        up = upv.get("us", float("nan"))
        note = f" ({upv['note']})" if upv.get("note") in ("one call",) or str(upv.get("note", "")).startswith("skip") else ""
        ok = "" if ours["ok"] else " FAIL"
        rt = r["routing"] + (f", {int(r['hole_frac'] * 100)}% -1" if r["hole_frac"] else "")
        lines.append(
            f"| {r['tp']} | {r['tokens']} | {rt} | {r['experts_touched']:.0f} | {r['floor_h200_us']:.1f} | "
            f"{r['floor_rtx6000_us']:.1f} | **{ours['us']:.1f}** | {v.get(E8M0 + ' ours', {}).get('us', float('nan')):.1f} | {up:.0f}{note} | {up / ours['us']:.0f}x | "
            f"{r['flops'] / ours['us'] / 1e6:.1f} | {r['bytes'] / ours['us'] / 1e3:.0f} | {ours['rel_err']:.1e}{ok} | "
            f"{r.get('plan', '')} |"
        )
    return "\n".join(lines)


def default_shapes(tps, decode, prefill) -> List[Shape]:
    shapes = []
    for tp in tps:
        shapes += [Shape(tp, m) for m in decode]
        shapes += [Shape(tp, m) for m in prefill]
        if tp == 4:  # adversarial routings
            shapes += [Shape(4, 64, "hot"), Shape(4, 16, "random", 0.25), Shape(4, 64, "dup"),
                       Shape(4, 1024, "hot"), Shape(4, 1024, "random", 0.25), Shape(4, 4096, "dup")]
    return shapes


QUICK_SIZES = "1,16,64,1024,4096"


def _warm_worker(job) -> int:
    """Compile (populate the on-disk Triton cache for) one variant at one shape, in a subprocess."""
    shape, quick, name = job
    import torch

    kws = build(shape, 1, 0)
    try:
        kw = e8m0_scales(kws[0]) if name.startswith(E8M0) else kws[0]
        (sweep_variants(shape) if quick else default_variants(shape))[name](**kw)
        torch.cuda.synchronize()
    except Exception as exc:  # reported again (and recorded) by the timing process
        print(f"prewarm: {name} at M={shape.tokens}: {exc}"[:300], file=sys.stderr)
        return 1
    return 0


def prewarm(shapes: List[Shape], quick: bool, procs: int) -> None:
    """Triton compiles one kernel at a time per process; spread the first compiles over processes
    (same GPU, same cache directory, so the timing process then finds every binary cached)."""
    import multiprocessing as mp

    jobs, seen = [], set()
    for sh in shapes:
        for name in (sweep_variants(sh) if quick else default_variants(sh)):
            key = (sh.tp, sh.tokens if sh.tokens <= 64 else 0, name)  # decode M changes BLOCK_S
            if key not in seen:
                seen.add(key)
                jobs.append((sh, quick, name))
    from v4flash_kernels.moe import bench as importable  # picklable by name when run with -m

    with mp.get_context("spawn").Pool(max(1, min(procs, len(jobs)))) as pool:
        pool.map(importable._warm_worker, jobs, chunksize=1)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_kernels.moe.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="4,1")
    ap.add_argument("--decode", default="1,2,4,8,16,32,64")
    ap.add_argument("--prefill", default="256,1024,4096,8192")
    ap.add_argument("--copies", type=int, default=4, help="weight copies rotated per timed call")
    ap.add_argument("--quick", action="store_true", help="sweep candidate configs at a few sizes (TP4)")
    ap.add_argument("--quick-sizes", default=QUICK_SIZES, help="the sizes --quick sweeps")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--prewarm", type=int, default=8, help="processes compiling kernels up front (0 = off)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA GPU", file=sys.stderr)
        return 2
    from v4flash_kernels.moe import op as moe

    if args.quick:
        shapes = [Shape(4, int(m)) for m in args.quick_sizes.split(",") if m]
    else:
        ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
        shapes = default_shapes(ints(args.tp), ints(args.decode), ints(args.prefill))
    upstream = None
    if not args.no_upstream and not args.quick:
        from v4flash_kernels.upstream import MOE_PATH, load_module

        upstream = load_module(MOE_PATH)
    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    t0 = time.time()
    if args.prewarm:
        prewarm(shapes, args.quick, args.prewarm)
        print(f"[{time.time() - t0:6.1f}s] kernels compiled", flush=True)
    rows = []
    for i, sh in enumerate(shapes):
        variants = sweep_variants(sh) if args.quick else default_variants(sh)
        copies = args.copies if sh.tp == 4 else max(2, args.copies - 1)
        r = run_shape(sh, variants, upstream, copies, seed + i, breakdown=args.quick)
        r["plan"] = moe.make_plan(sh.tokens, 6, 256, 4096, TP[sh.tp]).name
        rows.append(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": {"partial": True, "seed": seed}, "rows": rows}, f, indent=1)
        up = r["variants"].get("upstream", {}).get("us", float("nan"))
        print(f"[{time.time() - t0:6.1f}s] tp{sh.tp} M={sh.tokens} {sh.routing}: ours {r['variants']['ours']['us']:.1f} us"
              f" err {r['variants']['ours']['rel_err']:.2e} upstream {up:.1f} us", flush=True)
        if args.quick:
            for name, v in sorted(r["variants"].items(), key=lambda kv: kv[1]["us"]):
                parts = " ".join(f"{k.split(' ')[0]}={us:.1f}" for k, us in v.get("breakdown_us", {}).items())
                print(f"    {v['us']:9.1f} us  err {v['rel_err']:.1e} {'ok' if v['ok'] else 'FAIL'}  {name}  [{parts}]",
                      flush=True)
    props = torch.cuda.get_device_properties(0)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
                "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
                "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed,
                "upstream_origin": getattr(upstream, "__v4flash_origin__", None)}
    print(json.dumps(meta))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(format_markdown(rows) + "\n")
    return 0 if all(x["ok"] for r in rows for x in r["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
