"""Benchmark: check every variant against the fp64 reference, then time it under CUDA-graph replay.

    python -m v4flash_bench.attention [--json out.json] [--kinds swa,c4,...] [--batches 1,4,16,64]
                                    [--modes tp4,full64,h16] [--rank 1] [--sweep] [--no-upstream]

Per shape (DeepSeek-V4-Flash decode: SWA-only, c4 = 128 SWA + 512 c4, c128 at 128K / 256K) it
draws fresh random real-layout caches, runs ours (the dispatcher's plan, plus every config/plan in
the sweep with `--sweep`) and the pinned upstream wrapper (loaded from the sglang wheel), checks
each against the fp64 reference with NaN-poisoned outputs, then times each with
`triton.testing.do_bench` on a captured CUDA graph (L2 flushed before each replay, median) and
prints µs per call next to the bytes floor on the H200 and the RTX PRO 6000.

Modes: `tp4` is the call SGLang makes on attention-TP rank `--rank` of 4: a 64-head q whose 16 real
heads are this rank's and whose other 48 hold NaN/Inf/huge values, through `tp_heads.make_tp_aware`
(ours computes 16 heads; upstream, which cannot know the rank, computes all 64 as it does today);
only the rank's slice is checked. `full64` = 64 real heads (TP1), `h16` = a 16-head q. With the
B=1 rows of swa, c4 and c128@128K in `tp4` mode it also prints the attention time of one decode
step at 128K context: 2 SWA + 21 c4 + 20 c128 layers.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Tuple

from v4flash_kernels.kit.measure import time_graph
from v4flash_kernels.kit.table import variant_summary
from v4flash_kernels.provenance import measured_commit

BW_H200 = 4.3e12  # measured D2D copy bandwidth (bytes/s), reference doc §4
BW_RTX6000 = 1.792e12  # GDDR7 datasheet
REL_TOL = 1e-2
SM120_VARIANT = "sm120_choice"
ONE_LAUNCH_VARIANT = "one_launch"  # the planner's plan with the cooperative merge, where it does not use it
TWO_LAUNCH_VARIANT = "two_launch"  # the planner's plan with split + combine, where it uses the cooperative merge

# Exploration-only configs timed by --sweep next to the shipped table; a config from here may
# only ship after `check_sm120` passes it (some of these exceed sm_120 smem or spill there).
# Variants that need their own kernel path (register prefetch, the latent across warps) are timed
# by kernels/scripts/attention_variants.py.
EXPLORE_CONFIGS: Tuple[Dict[str, Any], ...] = (
    {"block_h": 64, "block_t": 16, "num_warps": 8},
)

# The decode's layer kinds as `reference.Case` fields.
KINDS: Dict[str, Dict[str, Any]] = {
    "swa": {"extra_width": 0},
    "c4": {"extra_width": 512, "extra_page_size": 64, "extra_dense": False},
    "c128@128K": {"extra_width": 1024, "extra_page_size": 2, "extra_dense": True},
    "c128@256K": {"extra_width": 2048, "extra_page_size": 2, "extra_dense": True},
}


MODES = {"tp4": 64, "full64": 64, "h16": 16}  # -> heads of q
TP4 = 4
STEP_LAYERS = (("swa", 2), ("c4", 21), ("c128@128K", 20))  # DeepSeek-V4-Flash: 43 attention layers


@dataclass(frozen=True)
class Shape:
    kind: str
    batch: int
    heads: int
    mode: str = "full64"
    rank: int = 0

    @property
    def head_slice(self) -> slice:
        """The heads that are real (checked); all of q's except in tp4 mode."""
        if self.mode != "tp4":
            return slice(0, self.heads)
        n = self.heads // TP4
        return slice(self.rank * n, (self.rank + 1) * n)


def poison_other_heads(q: Any, keep: slice) -> None:
    """Fill q's heads outside `keep` like SGLang's uninitialised pad: NaN, +Inf, -Inf, 3e38 in turn."""
    vals = (float("nan"), float("inf"), float("-inf"), 3.0e38)
    for h in range(q.shape[2]):
        if not keep.start <= h < keep.stop:
            q[:, :, h] = vals[h % len(vals)]


def floor_bytes(kw: Dict[str, Any], tokens: int) -> int:
    from v4flash_kernels.attention.reference import TOKEN_BYTES

    B, _, H, D = kw["q"].shape
    idx = sum(kw[k].numel() * 4 for k in ("indices", "extra_indices") if kw.get(k) is not None)
    return int(tokens * TOKEN_BYTES + 2 * B * H * D * 2 + idx + B * H * 4)


def check_call(fn: Callable[..., Any], kw: Dict[str, Any], ref_out: Any, ref_lse: Any, poison: bool,
               heads: slice | None = None) -> Dict[str, Any]:
    """Run `fn(**kw)` once on NaN-poisoned outputs (when it accepts them) and compare to the ref.

    With `heads`, the reference holds only those heads and only they are compared; with `poison`
    the other heads of out / lse must still be NaN afterwards (never written).
    """
    import torch

    from v4flash_kernels.kit.compare import rel_err

    extra = {}
    B, _, H, D = kw["q"].shape
    if poison:
        extra["out"] = torch.full((B, 1, H, D), float("nan"), dtype=torch.bfloat16, device=kw["q"].device)
        extra["lse"] = torch.full((B, 1, H), float("nan"), dtype=torch.float32, device=kw["q"].device)
    out, lse = fn(**kw, **extra)
    torch.cuda.synchronize() if out.is_cuda else None
    untouched = True
    if heads is not None:
        if poison:
            rest = torch.ones(H, dtype=torch.bool, device=out.device)
            rest[heads] = False
            untouched = bool(torch.isnan(out[:, :, rest].float()).all() and torch.isnan(lse[:, rest]).all())
        out, lse = out[:, :, heads], lse[:, heads]
    o = out.double()
    lse_d = lse.reshape(ref_lse.shape).double()
    nan = bool(torch.isnan(o).any() or torch.isnan(lse_d).any())
    err = rel_err(o, ref_out)
    fin = torch.isfinite(ref_lse)
    lse_err = float((lse_d[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
    lse_inf_ok = bool((lse_d[~fin] == ref_lse[~fin]).all())
    empty = ref_out.abs().amax(dim=(-1, -2, -3)) == 0  # rows with no valid token
    empty_zero = bool((o[empty] == 0).all()) if empty.any() else True
    ok = (not nan) and err <= REL_TOL and lse_err <= 1e-2 and lse_inf_ok and empty_zero and untouched
    return {"ok": ok, "rel_err": err, "lse_abs_err": lse_err, "nan": nan, "lse_inf_ok": lse_inf_ok,
                "empty_rows_zero": empty_zero, "other_heads_untouched": untouched}


def cache_widths(kw: Dict[str, Any]) -> Tuple[Any, ...]:
    """(top-k width of the SWA cache, of the extra cache or 0): what the planner keys on."""
    w_b = kw["extra_indices"].shape[-1] if kw.get("extra_indices") is not None else 0
    return kw["indices"].shape[-1], w_b


def bind_plan(plan: Any, heads: Tuple[Any, ...] | None = None) -> Callable[..., Any]:
    """`fn(out=None, lse=None, **inputs)` that runs the decode with this explicit plan (for A/B runs)."""
    from v4flash_kernels.attention import op as decode

    def call(out: Any = None, lse: Any = None, **kwargs: Any) -> Any:
        return decode.run(
            kwargs["q"], kwargs["k_cache"], kwargs["indices"], kwargs["topk_length"],
            kwargs["attn_sink"], kwargs["softmax_scale"], kwargs.get("extra_k_cache"),
            kwargs.get("extra_indices"), kwargs.get("extra_topk_length"), plan=plan, out=out, lse=lse,
            head_range=heads,
        )
    return call


def production_call(shape: Shape) -> Callable[..., Any]:
    """What SGLang runs with the patch: the TP-aware adapter around the public entry (fake rank in tp4)."""
    from v4flash_kernels.attention import op as decode
    from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware

    tp = AttnTp(shape.rank, TP4) if shape.mode == "tp4" else AttnTp(0, 1)
    fn = make_tp_aware(decode.sparse_mla_decode, read=lambda: tp)

    def call(out: Any = None, lse: Any = None, **kwargs: Any) -> Any:
        if out is not None:  # the adapter has upstream's signature; poison through the plan path
            sl = shape.head_slice
            return bind_plan(plan_for(shape, kwargs), (sl.start, sl.stop))(out=out, lse=lse, **kwargs)
        return fn(**_upstream_kwargs(kwargs))
    return call


def plan_for(shape: Shape, kw: Dict[str, Any], smem_per_sm: int | None = None) -> Any:
    from v4flash_kernels.attention import op as decode

    w_a, w_b = cache_widths(kw)
    sms, smem = decode._device_info(kw["q"].device)
    n = shape.head_slice.stop - shape.head_slice.start
    return decode.make_plan(shape.batch, n, w_a, w_b, sms, smem_per_sm=smem_per_sm or smem)


def variants_for(shape: Shape, kw: Dict[str, Any], sweep: bool) -> Dict[str, Callable[..., Any]]:
    from v4flash_kernels.attention import op as decode

    B = shape.batch
    H = shape.head_slice.stop - shape.head_slice.start
    heads = (shape.head_slice.start, shape.head_slice.stop) if shape.mode == "tp4" else None
    w_a, w_b = cache_widths(kw)
    sms = decode._num_sms(kw["q"].device)

    default = plan_for(shape, kw)
    out = {"ours": production_call(shape)}
    seen = {default}
    # What the dispatcher would launch on sm_120 (100 KB shared memory per SM), timed here too.
    sm120 = plan_for(shape, kw, smem_per_sm=102400)
    out[SM120_VARIANT] = bind_plan(sm120, heads)
    seen.add(sm120)
    # The same plan with the other merge: one launch (cooperative) <-> split + combine.
    programs = default.num_splits * -(-H // default.config.block_h) * B
    if default.num_splits > 1 and default.config.ksplit == 1 and decode.coop_fits(programs, sms):
        other = decode.Plan(default.config, default.chunk, default.splits_main, default.splits_extra,
                            fused=not default.fused)
        out[TWO_LAUNCH_VARIANT if default.fused else ONE_LAUNCH_VARIANT] = bind_plan(other, heads)
        seen.add(other)
    if sweep:
        explore = tuple(decode.KernelConfig(**c) for c in EXPLORE_CONFIGS)
        for cfg in tuple(decode.SPLIT_CONFIGS) + tuple(c for c in explore if c not in decode.SPLIT_CONFIGS):
            for min_tiles in (1, 2, 4):
                for cps in (2, 4, 8):
                    p = decode.make_plan(B, H, w_a, w_b, sms, config=cfg, min_tiles=min_tiles, ctas_per_sm=cps)
                    if p in seen:
                        continue
                    seen.add(p)
                    out[f"{cfg.name}/c{p.chunk}/s{p.num_splits}"] = bind_plan(p, heads)
    return out


def plan_desc(shape: Shape, kw: Dict[str, Any]) -> str:
    p = plan_for(shape, kw)
    return (f"{p.config.name} chunk={p.chunk} splits={p.splits_main}+{p.splits_extra}"
            f"{'' if p.num_splits == 1 else ' one launch' if p.fused else ' +combine'}")


def ref_inputs(kw: Dict[str, Any], keep: slice) -> Dict[str, Any]:
    """The inputs restricted to the real heads (the fp64 reference then costs 1/4 at tp4)."""
    out = dict(kw, q=kw["q"][:, :, keep])
    if kw.get("attn_sink") is not None:
        out["attn_sink"] = kw["attn_sink"][keep]
    return out


def run_shape(shape: Shape, sweep: bool, upstream: Any, seed: int) -> Dict[str, Any]:
    """Check then time every variant of one shape (upstream only if given)."""
    import torch

    from v4flash_kernels.attention.reference import Case, make_inputs, sparse_mla_decode_ref, valid_tokens

    case = Case(batch=shape.batch, heads=shape.heads, hole_frac=0.01, **KINDS[shape.kind])
    kw = make_inputs(case, device="cuda", seed=seed)
    keep = shape.head_slice
    if shape.mode == "tp4":
        poison_other_heads(kw["q"], keep)
    tokens = valid_tokens(kw)
    nbytes = floor_bytes(ref_inputs(kw, keep), tokens)
    ref_out, ref_lse = sparse_mla_decode_ref(**ref_inputs(kw, keep))
    row = dict(asdict(shape), tokens=tokens, bytes=nbytes, floor_h200_us=nbytes / BW_H200 * 1e6,
               floor_rtx6000_us=nbytes / BW_RTX6000 * 1e6, plan=plan_desc(shape, kw), variants={})
    fns = variants_for(shape, kw, sweep)
    if upstream is not None:
        def up(out: Any = None, lse: Any = None, **kwargs: Any) -> Any:
            return upstream.flash_mla_sparse_decode_triton(**_upstream_kwargs(kwargs))
        fns["upstream"] = up
    sl = keep if shape.mode == "tp4" else None
    for name, fn in fns.items():
        chk = check_call(fn, kw, ref_out, ref_lse, poison=name != "upstream", heads=sl)
        if name == "ours":  # the poisoned check above ran the same plan; now the real adapter call too
            direct = check_call(fn, kw, ref_out, ref_lse, poison=False, heads=sl)
            chk = dict(chk, ok=chk["ok"] and direct["ok"], rel_err=max(chk["rel_err"], direct["rel_err"]))
        us = time_graph(functools.partial(fn, **kw))
        row["variants"][name] = dict(chk, us=us)
    del kw, ref_out, ref_lse
    torch.cuda.empty_cache()
    return row


def _upstream_kwargs(kw: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "q": kw["q"], "k_cache": kw["k_cache"], "indices": kw["indices"], "topk_length": kw["topk_length"],
        "attn_sink": kw["attn_sink"], "head_dim_v": kw["head_dim_v"], "softmax_scale": kw["softmax_scale"],
        "extra_k_cache": kw.get("extra_k_cache"), "extra_indices": kw.get("extra_indices"),
        "extra_topk_length": kw.get("extra_topk_length"),
    }


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'kind':<10} {'mode':<6} {'B':>3} {'H':>3} {'tok':>7} {'floorH200':>9} {'floor6K':>8} {'ours':>8} "
            f"{'sm120cfg':>8} {'best':>8} {'upstream':>9} {'x_up':>6} {'err':>8}  plan / best variant")
    lines = [head, "-" * len(head)]
    for r in rows:
        v = r["variants"]
        ours, best_name, best, up, err, bad = variant_summary(v)
        s120 = v.get(SM120_VARIANT, {}).get("us", float("nan"))
        lines.append(
            f"{r['kind']:<10} {r.get('mode', ''):<6} {r['batch']:>3} {r['heads']:>3} {r['tokens']:>7} "
            f"{r['floor_h200_us']:>9.2f} {r['floor_rtx6000_us']:>8.2f} {ours:>8.1f} {s120:>8.1f} {best:>8.1f} {up:>9.1f} "
            f"{up / ours:>6.1f} {err:>8.1e}  {r['plan']} / {best_name}{bad}"
        )
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    """The BENCH.md table: µs per call (graph replay, L2 flushed, median) and the floors."""
    lines = [
        "| kind | mode | B | H | tokens | floor H200 | floor RTX 6000 | **ours** | other merge | sm_120 choice "
        "| upstream | ours vs upstream | rel. err | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["variants"]
        ours = v["ours"]
        up = v.get("upstream", {}).get("us", float("nan"))
        up_s = "– | –" if math.isnan(up) else f"{up:.0f} | {up / ours['us']:.1f}x"
        other = [f"{v[k]['us']:.1f} ({'1' if k == ONE_LAUNCH_VARIANT else '2'} launch)" for k in
                 (ONE_LAUNCH_VARIANT, TWO_LAUNCH_VARIANT) if k in v]
        one = other[0] if other else "–"
        ok = "" if ours["ok"] else " FAIL"
        lines.append(
            f"| {r['kind']} | {r.get('mode', '')} | {r['batch']} | {r['heads']} | {r['tokens']} | "
            f"{r['floor_h200_us']:.2f} | {r['floor_rtx6000_us']:.2f} | **{ours['us']:.1f}** | {one} | "
            f"{v.get(SM120_VARIANT, {}).get('us', float('nan')):.1f} | {up_s} | {ours['rel_err']:.1e}{ok} | {r['plan']} |"
        )
    return "\n".join(lines)


def step_time_us(rows: List[Dict[str, Any]], variant: str = "ours") -> float | None:
    """Sum of one decode step's attention calls at B=1, 128K, from the tp4 rows; None if any is missing."""
    by = {(r["kind"], r.get("mode"), r["batch"]): r for r in rows}
    total = 0.0
    for kind, n in STEP_LAYERS:
        r = by.get((kind, "tp4", 1))
        if r is None or variant not in r["variants"]:
            return None
        total += n * r["variants"][variant]["us"]
    return total


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.attention", description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--modes", default="tp4,full64,h16", help=f"any of {','.join(MODES)}")
    ap.add_argument("--rank", type=int, default=1, help="attention-TP rank of the tp4 mode (0-3)")
    ap.add_argument("--sweep", action="store_true", help="also time every config/plan in the table")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--upstream-modes", default="tp4", help="modes whose rows also time upstream (its 64-head "
                    "calls are slow; full64/h16 upstream rows are in the earlier BENCH.md tables)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the markdown table (for kernels/BENCH.md)")
    ap.add_argument("--seed", type=int, default=None, help="default: fresh random inputs each run")
    args = ap.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    upstream = None
    if not args.no_upstream:
        from v4flash_kernels.upstream import load_upstream

        upstream = load_upstream()
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes) or not 0 <= args.rank < TP4:
        print(f"error: --modes must be from {','.join(MODES)} and --rank 0-{TP4 - 1}\n"
              f"fix: e.g. --modes tp4,full64 --rank 1", file=sys.stderr)
        return 2
    # Mode-major: a run cut short still has every kind of the first mode (tp4: the targets, the step).
    shapes = [Shape(k, b, MODES[m], m, args.rank if m == "tp4" else 0) for m in modes
              for k in args.kinds.split(",") for b in map(int, args.batches.split(","))]
    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    rows = []
    t0 = time.time()
    for i, sh in enumerate(shapes):
        up = upstream if sh.mode in args.upstream_modes.split(",") else None
        rows.append(run_shape(sh, args.sweep, up, seed + i))
        r = rows[-1]
        if args.json:  # rewritten after every shape so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"meta": {"partial": True, "seed": seed}, "rows": rows}, f, indent=1)
        print(f"[{time.time() - t0:6.1f}s] {sh.kind} {sh.mode} B={sh.batch} H={sh.heads}: "
              f"ours {r['variants']['ours']['us']:.1f} us err {r['variants']['ours']['rel_err']:.2e}"
              + (f", upstream {r['variants']['upstream']['us']:.1f} us" if "upstream" in r["variants"] else ""),
              flush=True)
    table = format_table(rows)
    props = torch.cuda.get_device_properties(0)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed,
            "upstream_origin": getattr(upstream, "__v4flash_origin__", None)}
    step = step_time_us(rows)
    if step is not None:
        meta["tp4_step_b1_128k_us"] = step
    print(json.dumps(meta))
    print(table)
    if step is not None:
        print(f"attention per decode step, TP4 production call, B=1, 128K context "
              f"(2 SWA + 21 c4 + 20 c128 layers): {step / 1000:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(format_markdown(rows) + "\n")
    all_ok = all(x["ok"] for r in rows for k, x in r["variants"].items())
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
