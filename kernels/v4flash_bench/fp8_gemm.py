"""Benchmark of the block-FP8 linear: check against fp64 and upstream, then time under CUDA-graph replay.

    python -m v4flash_bench.fp8_gemm [--json out.json] [--md out.md] [--m 1,2,4,16,32,64,256,1024,8192]
        [--shapes wqkv_a,...] [--no-upstream]

Shapes are DeepSeek-V4-Flash's six block-FP8 linears at TP4 (N x K; the indexer's wq_b has the
attention wq_b's shape and shares its measurement). Per (shape, M) it draws bf16 activations and
`r` copies of an e4m3 weight with fp32 block scales, `r` chosen so the copies together exceed 3x
the L2 (each call streams its weight from memory, as a real step does), then for each of
* `ours`: `op.w8a8_block_fp8_linear` (the hook's replacement: fused quant+GEMM or quant, GEMM), and
* `upstream`: sglang 0.5.13.post1's `triton_w8a8_block_fp8_linear` read from the wheel, with the
  Triton activation quant (`_per_token_group_quant_8bit_raw`: SGLang's non-sgl-kernel path; the
  H200 box has no sgl-kernel) and `w8a8_block_fp8_matmul_triton` with its default config (the
  wheel has no tuned JSON for the RTX PRO 6000; a tuned H200 file would otherwise be picked here),
checks one call against the fp64 reference (and ours against upstream) and then times a CUDA graph
of the `r` calls (`attention.bench.time_graph`: median of replays, L2 flushed), reporting µs per
call, GB/s and TFLOP/s, % of the H200 bytes floor (measured copy bandwidth) and the RTX PRO 6000
floor (1.792 TB/s) beside them. Upstream is the baseline: always timed, its error against the
reference reported (`excess`, `within_bound`) but never a reason to refuse it (its Triton quant
rounds a few codes differently from the definition); ours is strictly checked and a failure fails the
run. The small-M design sweep is `python -m v4flash_bench.fp8_sweep` (time-bounded by `--budget-s`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from v4flash_kernels.fp8_gemm.upstream import upstream_fp8_linear
from v4flash_kernels.kit.device import num_sms
from v4flash_kernels.provenance import measured_commit

# The row counts, plus 2 and 32: where `op.plan` changes config between measured points.
M_LIST = (1, 2, 4, 16, 32, 64, 256, 1024, 8192)
BW_RTX6000 = 1.792e12
BW_H200_FALLBACK = 4.2e12  # only when the copy measurement is unavailable (recorded in the JSON)
ROT_MAX = 16


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int
    calls: int  # per B=1 decode step (43 layers; the indexer's only in the 21 c4 layers)


SHAPES = (
    Shape("wqkv_a", 1536, 4096, 43),
    Shape("wq_b", 8192, 1024, 43),
    Shape("wo_b", 4096, 2048, 43),
    Shape("indexer_wq_b", 8192, 1024, 21),
    Shape("shared_gate_up", 1024, 4096, 43),
    Shape("shared_down", 4096, 512, 43),
)
SHAPE_NAMES = ",".join(s.name for s in SHAPES if s.name != "indexer_wq_b")  # the indexer's wq_b = wq_b


# ----------------------------------------------------------------------------- one shape


def bytes_moved(m: int, n: int, k: int) -> int:
    """e4m3 weight + fp32 block scales + bf16 activation in + bf16 output (the floor's numerator)."""
    return n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4 + m * k * 2 + m * n * 2


def rotations(nbytes: int, l2_bytes: int) -> int:
    return max(1, min(ROT_MAX, math.ceil(3 * l2_bytes / max(1, nbytes))))


# Ours must match the reference quant bit for bit, so only output rounding (bf16: 2^-8 relative,
# 2^-7 bound) and fp32 accumulation (relative to the sum of |terms|) remain. Upstream's Triton quant
# computes the code as x * (1 / (amax / 448)), which can land one e4m3 step off the reference's
# x * (448 / amax) at a rounding tie: allow a few such codes per output.
ATOL_MAG = {"ours": 2.0 ** -12, "upstream": 2.0 ** -8}


def check_one(out: Any, x: Any, w: Any, ws: Any, who: str = "ours") -> Dict[str, Any]:
    from v4flash_kernels.fp8_gemm.reference import linear_ref
    from v4flash_kernels.kit.compare import excess_error, rel_err

    ref, mag = linear_ref(x, w, ws)
    ex = excess_error(out, ref, mag, rtol=2.0 ** -7, atol_mag=ATOL_MAG.get(who, ATOL_MAG["ours"]))
    return {"ok": bool(ex <= 1.0), "excess": ex, "rel_err": rel_err(out, ref)}


def run_shape(shape: Shape, m: int, up: ModuleType | None, seed: int, l2: int, bw_h200: float) -> Dict[str, Any]:
    """Ours and upstream at one (shape, M)."""
    import torch

    from v4flash_kernels.fp8_gemm import op
    from v4flash_kernels.fp8_gemm.reference import make_activation, make_weight
    from v4flash_kernels.kit.measure import time_graph

    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k = shape.n, shape.k
    nbytes = bytes_moved(m, n, k)
    r = rotations(n * k + m * k * 2, l2)
    x = make_activation(m, k, g, device="cuda")
    ws = [make_weight(n, k, g, device="cuda") for _ in range(r)]
    p = op.plan(m, n, k, num_sms(x.device))
    variants: Dict[str, Dict[str, Any]] = {}
    floor_h200 = nbytes / bw_h200 * 1e6
    row = {"shape": shape.name, "n": n, "k": k, "m": m, "calls_per_step": shape.calls, "bytes": nbytes,
           "flops": 2 * m * n * k, "rotations": r, "floor_h200_us": floor_h200,
           "floor_rtx6000_us": nbytes / BW_RTX6000 * 1e6, "plan": p.name, "variants": variants}

    def timed(fn: Callable[..., Any], ok: bool) -> float:
        if not ok:  # ours outside the strict bound: not timed, the run fails
            return float("nan")

        def many() -> None:
            for w, s in ws:
                fn(w, s)
        return time_graph(many, rep_ms=50) / r

    def add(name: str, fn: Callable[..., Any], other: Any = None) -> None:
        out = fn(*ws[0])
        res = check_one(out, x, *ws[0], who=name)
        if name == "upstream":  # the baseline: its error is reported, it is timed regardless
            res["within_bound"] = res.pop("ok")
        if other is not None:
            res["vs_upstream"] = (out.double() - other.double()).norm().item() / max(other.double().norm().item(), 1e-30)
        res["us"] = timed(fn, res.get("ok", True))
        res["gbps"] = nbytes / res["us"] / 1e3
        res["tflops"] = 2 * m * n * k / res["us"] / 1e6
        res["pct_h200_floor"] = 100 * floor_h200 / res["us"]
        variants[name] = res

    up_out = None
    if up is not None:
        def up_fn(w: Any, s: Any) -> Any:
            return up.triton_w8a8_block_fp8_linear(x, w, [128, 128], s)
        up_out = up_fn(*ws[0])
        add("upstream", up_fn)
    add("ours", lambda w, s: op.w8a8_block_fp8_linear(x, w, [128, 128], s), up_out)
    return row


# ----------------------------------------------------------------------------- tables


def step_ms(rows: List[Dict[str, Any]], m: int, variant: str) -> float:
    """ms per decode step of the six linears at this M (calls per step x µs per call)."""
    by = {r["shape"]: r for r in rows if r["m"] == m}
    total = 0.0
    for sh in SHAPES:
        r = by.get(sh.name) or by.get("wq_b" if sh.name == "indexer_wq_b" else "")
        if r is None or variant not in r["variants"]:
            return float("nan")
        total += sh.calls * r["variants"][variant]["us"]
    return total / 1e3


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'shape':<15} {'M':>5} {'floorH200':>9} {'floorRTX':>8} {'ours us':>8} {'GB/s':>6} {'TF/s':>6} "
            f"{'%H200':>6} {'up us':>8} {'up/ours':>7} {'excess':>7} {'up exc':>7}  plan")
    lines = [head, "-" * len(head)]
    for r in rows:
        v = r["variants"]
        o = v.get("ours", {})
        u = v.get("upstream", {})
        ou, uu = o.get("us", float("nan")), u.get("us", float("nan"))
        bad = [name for name, x in v.items() if not x.get("ok", True)]
        lines.append(
            f"{r['shape']:<15} {r['m']:>5} {r['floor_h200_us']:>9.2f} {r['floor_rtx6000_us']:>8.2f} {ou:>8.2f} "
            f"{o.get('gbps', float('nan')):>6.0f} {o.get('tflops', float('nan')):>6.1f} "
            f"{o.get('pct_h200_floor', float('nan')):>6.1f} {uu:>8.2f} {uu / ou:>7.2f} {o.get('excess', float('nan')):>7.2f}"
            f" {u.get('excess', float('nan')):>7.2f}"
            f"  {r['plan']}" + ("" if not bad else "  FAIL:" + ",".join(bad)))
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]], ms: List[int]) -> str:
    lines = [
        "| shape (N x K) | M | H200 floor µs | RTX PRO 6000 floor µs | **ours µs** | GB/s | TFLOP/s | % of H200 floor "
        "| upstream µs | upstream / ours | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = r["variants"].get("ours", {})
        u = r["variants"].get("upstream", {})
        ou, uu = o.get("us", float("nan")), u.get("us", float("nan"))
        lines.append(
            f"| {r['shape']} ({r['n']}x{r['k']}) | {r['m']} | {r['floor_h200_us']:.2f} | {r['floor_rtx6000_us']:.2f} | "
            f"**{ou:.2f}** | {o.get('gbps', float('nan')):.0f} | {o.get('tflops', float('nan')):.1f} | "
            f"{o.get('pct_h200_floor', float('nan')):.0f} % | {uu:.2f} | {uu / ou:.2f}x | {r['plan']} |")
    lines.append("")
    lines.append("| M | six linears per decode step, ours ms | upstream ms |")
    lines.append("|---|---|---|")
    for m in ms:
        lines.append(f"| {m} | {step_ms(rows, m, 'ours'):.3f} | {step_ms(rows, m, 'upstream'):.3f} |")
    return "\n".join(lines)


def copy_bandwidth_or_fallback() -> Tuple[float, str]:
    try:
        from v4flash_kernels.kit.measure import copy_bandwidth

        return copy_bandwidth(), "measured D2D copy (kit.measure.copy_bandwidth)"
    except Exception as exc:  # no measurement: say so in the JSON, use the documented figure
        return BW_H200_FALLBACK, f"constant {BW_H200_FALLBACK:.2e} ({type(exc).__name__}: {exc})"


def process_start() -> float:
    """Wall time this process started (Linux /proc), so a sweep budget counts the imports too."""
    import os

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.fp8_gemm", description=__doc__.split("\n")[0])
    ap.add_argument("--m", default=None, help=f"default {','.join(str(m) for m in M_LIST)}")
    ap.add_argument("--shapes", default=SHAPE_NAMES)
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the markdown table (for kernels/BENCH.md)")
    ap.add_argument("--seed", type=int, default=None, help="default: fresh random inputs each run")
    args = ap.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("fp8_gemm.bench needs a CUDA GPU", file=sys.stderr)
        return 2
    up = None if args.no_upstream else upstream_fp8_linear()
    shapes = [s for s in SHAPES if s.name in args.shapes.split(",")]
    ms = [int(x) for x in (args.m or ",".join(str(m) for m in M_LIST)).split(",")]
    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw, bw_src = copy_bandwidth_or_fallback()
    props = torch.cuda.get_device_properties(0)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed, "bw_h200": bw, "bw_source": bw_src,
            "bw_rtx6000": BW_RTX6000, "sweep": False, "upstream_origin": getattr(up, "__v4flash_origin__", None)}
    rows: List[Dict[str, Any]] = []
    failed: List[Dict[str, Any]] = []
    t0 = time.time()

    def dump(partial: bool) -> None:
        if args.json:  # rewritten after every point so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"meta": dict(meta, partial=partial), "rows": rows, "failed": failed}, f, indent=1)

    for i, sh in enumerate(shapes):
        for j, m in enumerate(ms):
            try:
                r = run_shape(sh, m, up, seed + 100 * i + j, l2, bw)
            except Exception as exc:  # one broken point must not lose the others' rows
                import traceback

                traceback.print_exc()
                failed.append({"shape": sh.name, "m": m, "error": f"{type(exc).__name__}: {exc}"})
                torch.cuda.empty_cache()
                continue
            rows.append(r)
            dump(True)
            v = r["variants"]
            desc = " ".join(f"{n} {x['us']:.2f}" for n, x in v.items())
            print(f"[{time.time() - t0:5.1f}s] {sh.name} M={m}: {desc} us", flush=True)
            torch.cuda.empty_cache()
    print(json.dumps(meta))
    print(format_table(rows))
    for m in ms:
        print(f"M={m}: six linears per step: ours {step_ms(rows, m, 'ours'):.3f} ms, "
              f"upstream {step_ms(rows, m, 'upstream'):.3f} ms")
    dump(False)
    if args.md:
        with open(args.md, "w") as f:
            f.write(format_markdown(rows, ms) + "\n")
    for f_ in failed:
        print(f"FAILED: {f_}")
    ok = not failed and all(x.get("ok", True) for r in rows for x in r["variants"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
