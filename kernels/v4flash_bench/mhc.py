"""Benchmark of the mHC boundary: check against fp64 (and upstream), then time under CUDA-graph replay.

    python -m v4flash_bench.mhc [--json out.json] [--tokens 1,16,64,1024,8192]
        [--no-upstream] [--upstream-fused] [--sweep] [--seed N]

Per token count it draws DeepSeek-V4-Flash-shaped inputs (4 streams x 4096, `hc_fn` [24, 16384]),
runs ours: the pre alone (`mhc_pre`, without and with the sub-layer's RMSNorm), the post alone
(`mhc_post`) and the fused post+pre with the norm (`mhc_post_pre`, what the model runs at every
boundary once the patch is on), checks each against the fp64 reference (the fused one also against
the unfused pair on the same inputs), then times each with `triton.testing.do_bench` on a captured
CUDA graph (L2 flushed before each replay, median µs). At decode sizes also `post_pre_chain`: µs
per boundary of 16 fused boundaries in one graph (distinct weights, each feeding the next), i.e.
without the replay's fixed cost, as a boundary costs inside the model's graph.

Upstream, when `tilelang` imports here: the pinned sm_120 path, i.e. `DeepseekV4DecoderLayer.hc_pre`
(torch fp32 GEMV + RMS, `torch.compile`d as under SGLang's graph capture; TileLang
`hc_split_sinkhorn`; torch combine) and `hc_post` (TileLang `mhc_post`), read from the sglang wheel
at run time; with `--upstream-fused` also the gated-off TileLang `mhc_fused_post_pre` (several
TileLang JIT compiles: minutes). `--sweep` times alternative plans at the decode sizes (one launch:
tokens per ticketed block x hidden splits; the two-launch plan).

Upstream's code is loaded by `v4flash_kernels.mhc.upstream`, the checks are `v4flash_kernels.mhc.checks`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from typing import Any, Callable, Dict, List, Tuple, TypedDict

import torch

from v4flash_kernels.kit.device import num_sms
from v4flash_kernels.kit.measure import time_graph
from v4flash_kernels.mhc import reference as R
from v4flash_kernels.mhc.checks import TOL, check_against_pair, check_post_pre, check_pre, check_streams
from v4flash_kernels.mhc.upstream import UpstreamSm120, tilelang_available, upstream_tilelang_fused
from v4flash_kernels.provenance import measured_commit

BW_H200 = 4.3e12
TOKENS = (1, 16, 64, 1024, 8192)

# --------------------------------------------------------------------------- bench


def bytes_floor(n: int, hidden: int = 4096) -> Dict[str, int]:
    """Minimum HBM bytes per call: hc_fn once, the streams / sub-layer output / results once."""
    fn = R.MIX * R.HC * hidden * 4
    s = n * R.HC * hidden * 2
    y = n * hidden * 2
    return {"pre": fn + s + y, "post": 2 * s + y, "post_pre": fn + 2 * s + 2 * y}


CHAIN = 16  # boundaries per timed graph: eight layers' worth


class PreScalars(TypedDict):
    """The keyword scalars every mhc_pre / mhc_post_pre call here shares: typed so `**common` is checked."""

    rms_eps: float
    hc_eps: float
    sinkhorn_iters: int


def chain_fn(kw: Dict[str, Any], p: R.MhcParams, common: PreScalars) -> Callable[..., Any]:
    """`CHAIN` fused boundaries, each with its own copy of hc_fn / scale / base / norm weight (so each
    reads them from HBM after the bench's L2 flush, as a layer does), each one's streams, post, comb
    and layer input feeding the next as its residual, post, comb and sub-layer output."""
    from v4flash_kernels.mhc import op

    weights = [(kw["hc_fn"].clone(), kw["hc_scale"].clone(), kw["hc_base"].clone(), kw["norm_weight"].clone())
               for _ in range(CHAIN)]

    def run() -> Any:
        x, res, post, comb = kw["x"], kw["residual"], kw["post"], kw["comb"]
        for fn, sc, ba, w in weights:
            res, x, post, comb = op.mhc_post_pre(x, res, post, comb, fn, sc, ba, **common, norm_weight=w,
                                                 norm_eps=p.norm_eps)
        return res
    return run


def sweep_plans(n: int, hidden: int) -> List[Any]:
    """Decode alternatives to the shipped plan: one launch with 1..16 tokens per ticketed block and
    16..256 hidden splits (up to ~4 waves of one program per SM), and the two-launch plan."""
    from v4flash_kernels.mhc import op

    out = []
    for tokens in (1, 2, 4, 8, 16):
        blocks = -(-n // tokens)
        if tokens > max(4, n) or blocks > 16:
            continue
        for splits in (16, 32, 64, 128, 256):
            if blocks * splits <= 512:
                out.append(op.decode_plan(tokens, splits, hidden))
    out.append(op.make_plan(max(16, 1 << (n - 1).bit_length()), 128, op.BLOCK_H, hidden))
    return list({p.name: p for p in out}.values())  # small hidden sizes round several to one plan


def run_tokens(n: int, seed: int, upstream: UpstreamSm120 | None, upstream_fused: types.ModuleType | None,
               sweep: bool, device: str = "cuda", hidden: int = 4096, timer: Callable[..., Any] | None = None) -> Dict[str,
               Any]:
    """One token count: every variant checked against fp64, then timed (`timer`, default CUDA-graph replay)."""
    from v4flash_kernels.mhc import op

    _time_fn = timer or time_graph
    case = R.MhcCase(tokens=n, hidden=hidden)
    p = case.params
    kw = R.make_inputs(case, device=device, seed=seed)
    tol = TOL
    x, res, post_in, comb_in = kw["x"], kw["residual"], kw["post"], kw["comb"]
    fn, sc, ba, w = kw["hc_fn"], kw["hc_scale"], kw["hc_base"], kw["norm_weight"]
    common = PreScalars(rms_eps=p.rms_eps, hc_eps=p.pre_eps, sinkhorn_iters=p.iters)
    plan = op.plan_for(n, case.hidden, num_sms(x.device))
    floor = bytes_floor(n, hidden)
    row: Dict[str, Any] = {"tokens": n, "plan": plan.name, "floor_us": {k: v / BW_H200 * 1e6 for k, v in floor.items()},
                     "variants": {}}
    v = row["variants"]

    ref = R.pre_ref(res, fn, sc, ba, p)
    plain = R.layer_input_ref(ref["y"], None, p.norm_eps)
    normed = R.layer_input_ref(ref["y"], w, p.norm_eps)
    def pre_fn() -> Tuple[Any, Any, Any]:
        return op.mhc_pre(res, fn, sc, ba, **common)

    def pre_norm_fn() -> Tuple[Any, Any, Any]:
        return op.mhc_pre(res, fn, sc, ba, **common, norm_weight=w, norm_eps=p.norm_eps)

    v["pre"] = check_pre(*pre_fn(), ref, plain, tol)
    v["pre_norm"] = check_pre(*pre_norm_fn(), ref, normed, tol, normed=True)
    post_ref = R.post_ref(x, res, post_in, comb_in)
    def post_fn() -> Any:
        return op.mhc_post(x, res, post_in, comb_in)

    v["post"] = check_streams(post_fn(), post_ref, tol)

    def post_pre_fn(plan_: Any = None) -> Any:
        return lambda: op.mhc_post_pre(x, res, post_in, comb_in, fn, sc, ba, **common, norm_weight=w,
                                       norm_eps=p.norm_eps, plan=plan_)

    def check_fused(out: Any) -> Dict[str, Any]:
        cur, y, post, comb = out
        return check_post_pre(cur, y, post, comb, kw, p, tol)

    fused_out = post_pre_fn()()
    v["post_pre"] = check_fused(fused_out)
    pair_cur = post_fn()
    pair = (pair_cur, *op.mhc_pre(pair_cur, fn, sc, ba, **common, norm_weight=w, norm_eps=p.norm_eps))
    v["post_pre_vs_pair"] = check_against_pair(fused_out, pair, tol)
    for name, f in (("pre", pre_fn), ("pre_norm", pre_norm_fn), ("post", post_fn), ("post_pre", post_pre_fn())):
        v[name]["us"] = _time_fn(f) if v[name]["ok"] else float("nan")
    if n <= op.DECODE_MAX_TOKENS:
        # In a model graph: CHAIN boundaries back to back, each with its own weights (read from HBM as
        # a layer's are), each feeding the next; no per-replay overhead in the per-boundary figure.
        v["post_pre_chain"] = {"ok": v["post_pre"]["ok"], "err": {}, "boundaries": CHAIN}
        v["post_pre_chain"]["us"] = (_time_fn(chain_fn(kw, p, common)) / CHAIN if v["post_pre"]["ok"]
                                     else float("nan"))
    if sweep and n <= op.DECODE_MAX_TOKENS:
        for alt in sweep_plans(n, case.hidden):
            name = f"sweep:{alt.name}"
            v[name] = check_fused(post_pre_fn(alt)())
            v[name]["us"] = _time_fn(post_pre_fn(alt)) if v[name]["ok"] else float("nan")
    if upstream is not None:
        ref = R.pre_ref(res, fn, sc, ba, p)
        up = upstream

        def up_pre() -> Any:
            return up.pre(res, fn, sc, ba)

        y, post, comb, fused = up_pre()
        v["upstream_sm120_pre"] = check_pre(y, post, comb, ref, plain, tol)
        v["upstream_sm120_post"] = check_streams(upstream.post(x, res, post_in, comb_in), post_ref, tol)
        v["upstream_sm120_pre"]["us"] = _time_fn(up_pre)
        v["upstream_sm120_post"]["us"] = _time_fn(lambda: upstream.post(x, res, post_in, comb_in))
        if upstream_fused is not None:
            tlm = upstream_fused

            def up_fused() -> Any:
                return tlm.mhc_fused_post_pre(x, res, post_in.unsqueeze(-1), comb_in, fn, sc, ba, p.rms_eps, p.pre_eps,
                                              p.sinkhorn_eps, p.post_mult, p.iters, norm_weight=w,
                                              norm_eps=p.norm_eps)

            cur, post, comb, y = up_fused()
            v["upstream_tilelang_post_pre"] = check_fused((cur, y, post.squeeze(-1), comb))
            v["upstream_tilelang_post_pre"]["us"] = _time_fn(up_fused)
    # Per layer: the model with the patch runs two fused boundaries; upstream's sm_120 path two pre
    # + two post (its two RMSNorms not included). "ours" sums one-call graph replays like upstream's
    # figures (each with the replay's fixed cost); "ours_chain" is the in-model cost per layer.
    row["layer_us"] = {"ours": 2 * v["post_pre"]["us"]}
    if "post_pre_chain" in v:
        row["layer_us"]["ours_chain"] = 2 * v["post_pre_chain"]["us"]
    if "upstream_sm120_pre" in v:
        row["layer_us"]["upstream_sm120"] = 2 * (v["upstream_sm120_pre"]["us"] + v["upstream_sm120_post"]["us"])
    if "upstream_tilelang_post_pre" in v:
        row["layer_us"]["upstream_tilelang_fused"] = 2 * v["upstream_tilelang_post_pre"]["us"]
    return row


def format_table(rows: List[Dict[str, Any]]) -> str:
    cols = ("pre", "pre_norm", "post", "post_pre", "post_pre_chain", "upstream_sm120_pre", "upstream_sm120_post",
            "upstream_tilelang_post_pre")
    head = (f"{'tokens':>6} {'plan':<22}" + "".join(f"{c[-18:]:>20}" for c in cols)
            + f"{'layer ours':>11}{'in graph':>9}  check")
    lines = [head, "-" * len(head)]
    for r in rows:
        v = r["variants"]
        cells = "".join(f"{v[c]['us']:>20.1f}" if c in v else f"{'-':>20}" for c in cols)
        bad = [k for k, x in v.items() if not x["ok"]]
        chain = r["layer_us"].get("ours_chain")
        lines.append(f"{r['tokens']:>6} {r['plan']:<22}{cells}{r['layer_us']['ours']:>11.1f}"
                     + (f"{chain:>9.1f}" if chain is not None else f"{'-':>9}") + "  "
                     + ("ok" if not bad else "FAIL:" + ",".join(bad)))
    sweeps = [(r["tokens"], k, x) for r in rows for k, x in r["variants"].items() if k.startswith("sweep:")]
    if sweeps:
        lines.append("\nsweep (fused post+pre, us):")
        lines += [f"  tokens={n:<5} {k[6:]:<26} {x['us']:8.1f}  {'ok' if x['ok'] else 'FAIL'}" for n, k, x in sweeps]
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.mhc", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--upstream-fused", action="store_true", help="also TileLang mhc_fused_post_pre (slow JIT)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mhc bench needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    upstream, up_fused, up_note = None, None, "not requested"
    if not args.no_upstream:
        if tilelang_available():
            upstream, up_note = UpstreamSm120(kind="compiled"), "tilelang; torch part compiled as under graph capture"
            up_fused = upstream_tilelang_fused() if args.upstream_fused else None
        else:
            up_note = "tilelang not importable: upstream not timed"
    rows: List[Dict[str, Any]] = []
    failed: List[Dict[str, Any]] = []
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
                "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
                "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed, "upstream": up_note,
                "upstream_origin": getattr(getattr(upstream, "tl", None), "__v4flash_origin__", None)}

    def dump(partial: bool) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": dict(meta, partial=partial), "rows": rows, "failed": failed}, f, indent=1)

    for i, n in enumerate(int(t) for t in args.tokens.split(",")):
        try:
            r = run_tokens(n, seed + i, upstream, up_fused, args.sweep)
            torch.cuda.empty_cache()
        except Exception as exc:  # one broken shape must not lose the others' rows
            import traceback

            traceback.print_exc()
            failed.append({"tokens": n, "error": f"{type(exc).__name__}: {exc}"})
            torch.cuda.empty_cache()
            continue
        rows.append(r)
        dump(True)
        v = r["variants"]
        print(f"[{time.time() - t0:6.1f}s] tokens={n}: pre {v['pre']['us']:.1f} us, post {v['post']['us']:.1f}, "
              f"post+pre {v['post_pre']['us']:.1f}, layer {r['layer_us']}", flush=True)
    print(json.dumps(meta))
    print(format_table(rows))
    dump(False)
    for f_ in failed:
        print(f"FAILED: {f_}")
    return 0 if not failed and all(x["ok"] for r in rows for x in r["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
