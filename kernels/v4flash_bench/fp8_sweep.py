"""The time-bounded small-M design sweep of the block-FP8 linear, over `fp8_candidates`.

    python -m v4flash_bench.fp8_sweep [--json X] [--budget-s 135] [--m 1,64,4,16] [--shapes ...] [--no-upstream]

Per (M, shape), M in priority order (1, 64, 4, 16: the B=1 step first), it times under the main
bench's method (CUDA graph of `r` calls, weights rotated past 3x L2, L2 flushed between replays):
`upstream` (sglang's Triton quant + GEMM, default config: the baseline, always timed, its error
reported, never refused), `planned` (what `op` ships today), the `candidates` module's GEMV and
tensor-core variants, and once per shape the calibration launches (an empty kernel, a weight-only
read). Every GEMM variant is checked against the fp64 reference; ours are marked `ok` only within
the strict bound (a failing candidate is still timed, marked, and never picked).

It stops cleanly before `--budget-s` seconds since start (compiles included), finishing the
variant in flight, and the JSON is rewritten after every point, so a cut run keeps what it
measured and says what it skipped (`meta.skipped`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import v4flash_bench.fp8_gemm as bench

SWEEP_M = (1, 64, 4, 16)
MARGIN_S = 4.0  # stop when less than this is left: one more compile + timing could overrun
WARMUP_MS, REP_MS = 5, 20


def _time(fn: Callable[..., Any], ws: List[Any]) -> float:
    """µs per call: a CUDA graph of one call per rotated weight, median replay / r."""
    from v4flash_kernels.kit.measure import time_graph

    def many() -> None:
        for w, s in ws:
            fn(w, s)
    return time_graph(many, warmup_ms=WARMUP_MS, rep_ms=REP_MS) / len(ws)


def _context_alive() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return bool((torch.ones(4, device="cuda") * 2).sum().item() == 8.0)
    except Exception:
        return False


def run_point(shape: Any, m: int, up: Any, seed: int, l2: int, bw: float, deadline: float, calibrate: bool) -> Dict[str,
              Any]:
    import torch

    import v4flash_bench.fp8_candidates as cand
    from v4flash_kernels.fp8_gemm import op
    from v4flash_kernels.fp8_gemm.reference import linear_ref, make_activation, make_weight
    from v4flash_kernels.kit.compare import excess_error, rel_err
    from v4flash_kernels.kit.device import num_sms

    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k = shape.n, shape.k
    sms = num_sms(torch.device("cuda"))
    nbytes = bench.bytes_moved(m, n, k)
    r = bench.rotations(n * k + m * k * 2, l2)
    x = make_activation(m, k, g, device="cuda")
    ws = [make_weight(n, k, g, device="cuda") for _ in range(r)]
    ref, mag = linear_ref(x, *ws[0])
    floor = nbytes / bw * 1e6
    variants: Dict[str, Dict[str, Any]] = {}
    row = {"shape": shape.name, "n": n, "k": k, "m": m, "calls_per_step": shape.calls, "bytes": nbytes,
           "rotations": r, "floor_h200_us": floor, "floor_rtx6000_us": nbytes / bench.BW_RTX6000 * 1e6,
           "plan": op.plan(m, n, k, sms).name, "variants": variants, "cut": False}

    todo: List[Tuple[str, Callable[..., Any], str]] = []
    if up is not None:
        todo.append(("upstream", lambda x_, w, s: up.triton_w8a8_block_fp8_linear(x_, w, [128, 128], s), "upstream"))
    todo.append(("planned", lambda x_, w, s: op.w8a8_block_fp8_linear(x_, w, [128, 128], s), "ours"))
    if calibrate:
        todo += [(name, fn, "calibration") for name, fn in cand.calibration_variants(n, k, sms)]
    ours = cand.sweep_variants(m, n, k, sms)
    # PDL last: a launch attribute the graph capture might refuse must not cost the point's other rows
    todo += [(name, fn, "ours") for name, fn in sorted(ours, key=lambda t: t[0].endswith("_pdl"))]

    for name, fn, kind in todo:
        if time.time() > deadline:
            row["cut"] = True
            row["not_run"] = [t[0] for t in todo if t[0] not in variants]
            break
        t0 = time.time()
        res: Dict[str, Any] = {"kind": kind}
        try:
            out = fn(x, *ws[0])
            torch.cuda.synchronize()
            if kind != "calibration":
                ex = excess_error(out, ref, mag, rtol=2.0 ** -7, atol_mag=bench.ATOL_MAG.get(kind, bench.ATOL_MAG["ours"]))
                res.update(excess=ex, rel_err=rel_err(out, ref))
                if kind == "upstream":
                    res["within_bound"] = bool(ex <= 1.0)  # reported, not a verdict: the baseline is always timed
                else:
                    res["ok"] = bool(ex <= 1.0)
            us = _time(lambda w, s, f=fn: f(x, w, s), ws)
            res.update(us=us, gbps=nbytes / us / 1e3, pct_h200_floor=100 * floor / us)
        except Exception as exc:  # a candidate that does not compile or launch here: reported, not fatal
            res.update(ok=False, us=float("nan"), error=f"{type(exc).__name__}: {str(exc)[:400]}")
            if not _context_alive():
                row["fatal"] = res["error"]  # a fault poisons the CUDA context: the caller stops
                variants[name] = res
                break
        res["wall_s"] = round(time.time() - t0, 2)
        variants[name] = res
    return row


def best_of(row: Dict[str, Any]) -> Tuple[str, float]:
    """The fastest candidate or planned variant that passed the strict check."""
    ok = [(v["us"], n) for n, v in row["variants"].items()
          if v.get("kind") == "ours" and v.get("ok") and v["us"] == v["us"]]
    if not ok:
        return "-", float("nan")
    us, name = min(ok)
    return name, us


def format_sweep(rows: List[Dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        v = r["variants"]
        up = v.get("upstream", {}).get("us", float("nan"))
        pl = v.get("planned", {}).get("us", float("nan"))
        bname, bus = best_of(r)
        lines.append(f"== {r['shape']} ({r['n']}x{r['k']}) M={r['m']}: floor {r['floor_h200_us']:.2f} us, "
                     f"upstream {up:.2f}, planned {pl:.2f} ({r['plan']}), best {bus:.2f} {bname}"
                     + (" [CUT]" if r.get("cut") else ""))
        for name, x in sorted(v.items(), key=lambda kv: kv[1]["us"] if kv[1]["us"] == kv[1]["us"] else math.inf):
            flag = "" if x.get("ok", True) else ("  FAIL " + x.get("error", f"excess {x.get('excess', 0):.3g}"))[:160]
            extra = f" excess {x['excess']:.3g}" if "excess" in x else ""
            if x.get("within_bound") is False:
                extra += " (upstream: outside ours' strict bound, reported only)"
            lines.append(f"   {x['us']:8.2f} us {x.get('pct_h200_floor', float('nan')):5.1f}%  {name}{extra}{flag}")
    return "\n".join(lines)


def step_table(rows: List[Dict[str, Any]], shapes: Any) -> str:
    """ms per decode step of the six linears at each M: upstream, planned, best candidate per shape."""
    lines = ["M    upstream_ms planned_ms best_ms  (indexer_wq_b counted as wq_b)"]
    for m in sorted({r["m"] for r in rows}):
        by = {r["shape"]: r for r in rows if r["m"] == m}
        tot = {"upstream": 0.0, "planned": 0.0, "best": 0.0}
        for sh in shapes:
            r = by.get(sh.name) or by.get("wq_b" if sh.name == "indexer_wq_b" else "")
            if r is None:
                tot = {key: float("nan") for key in tot}
                break
            tot["upstream"] += sh.calls * r["variants"].get("upstream", {}).get("us", float("nan"))
            tot["planned"] += sh.calls * r["variants"].get("planned", {}).get("us", float("nan"))
            tot["best"] += sh.calls * best_of(r)[1]
        lines.append(f"{m:<4} {tot['upstream'] / 1e3:11.3f} {tot['planned'] / 1e3:10.3f} {tot['best'] / 1e3:7.3f}")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    t_start = bench.process_start()
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.fp8_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--m", default=",".join(str(m) for m in SWEEP_M), help="row counts, in priority order")
    ap.add_argument("--shapes", default=bench.SHAPE_NAMES)
    ap.add_argument("--budget-s", type=float, default=135.0,
                    help="stop cleanly this many seconds after the process started")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=None, help="default: fresh random inputs each run")
    args = ap.parse_args(argv)

    import torch
    import triton

    from v4flash_kernels.fp8_gemm.upstream import upstream_fp8_linear
    from v4flash_kernels.provenance import measured_commit

    if not torch.cuda.is_available():
        print("fp8_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    deadline = t_start + args.budget_s - MARGIN_S
    up = None if args.no_upstream else upstream_fp8_linear()
    shapes = [s for s in bench.SHAPES if s.name in args.shapes.split(",")]
    ms = [int(x) for x in args.m.split(",")]
    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    props = torch.cuda.get_device_properties(0)
    bw, bw_src = bench.copy_bandwidth_or_fallback()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed, "bw_h200": bw, "bw_source": bw_src,
            "sweep": True, "budget_s": args.budget_s, "timing": {"warmup_ms": WARMUP_MS, "rep_ms": REP_MS},
            "upstream_origin": getattr(up, "__v4flash_origin__", None), "skipped": []}
    rows: List[Dict[str, Any]] = []

    def dump(partial: bool) -> None:
        if args.json:
            meta["elapsed_s"] = round(time.time() - t_start, 1)
            with open(args.json, "w") as f:
                json.dump({"meta": dict(meta, partial=partial), "rows": rows}, f, indent=1)

    calibrated = set()
    fatal = None
    for m in ms:
        for i, sh in enumerate(shapes):
            if fatal or time.time() > deadline:
                meta["skipped"].append({"shape": sh.name, "m": m})
                continue
            t0 = time.time()
            r = run_point(sh, m, up, seed + 100 * i + m, props.L2_cache_size, bw, deadline, sh.name not in calibrated)
            calibrated.add(sh.name)
            rows.append(r)
            fatal = r.get("fatal")
            dump(True)
            bname, bus = best_of(r)
            print(f"[{time.time() - t_start:6.1f}s] {sh.name} M={m}: {len(r['variants'])} variants in "
                  f"{time.time() - t0:.1f}s; upstream {r['variants'].get('upstream', {}).get('us', float('nan')):.2f} "
                  f"planned {r['variants'].get('planned', {}).get('us', float('nan')):.2f} best {bus:.2f} {bname}"
                  + (" [CUT: budget]" if r["cut"] else ""), flush=True)
            torch.cuda.empty_cache()
    print(json.dumps({k: meta[k] for k in ("gpu", "commit", "seed", "bw_h200", "budget_s")}))
    print(format_sweep(rows))
    print(step_table(rows, bench.SHAPES))
    if meta["skipped"]:
        print(f"SKIPPED (budget or fatal error): {meta['skipped']}")
    if fatal:
        print(f"FATAL: {fatal}")
    dump(False)
    return 1 if fatal or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
