"""Benchmark of the indexer logits: check against fp64 and upstream, then time under CUDA-graph replay.

    python -m v4flash_bench.indexer [--json out.json] [--md out.md] [--batches 1,4,16,64]
        [--contexts 128K,1M] [--actual 4K,64K,128K,full] [--sweep] [--no-upstream]

Shapes are DeepSeek-V4-Flash decode calls of one c4 layer: a configured context C tokens gives a
page table of C/256 columns and `max_seq_len` = C/4 compressed positions (what SGLang passes under
CUDA graphs: `PagedIndexerMetadata.max_c4_seq_len`); an actual length of L tokens gives every row
`seq_lens` = L/4. Per shape it draws a fresh real-layout pool on the GPU (distinct pages per row,
random order), runs ours on a NaN-poisoned output, ours without the -inf tail (to show what the
fill costs: the same binary and programs per row over a `max_seq_len` cut at the last valid tile)
and the pinned upstream `fp8_paged_mqa_logits_torch_sm120` (read from the sglang
wheel), checks ours and upstream against the fp64 reference and each other, then times each with
`triton.testing.do_bench` on a captured CUDA graph (L2 flushed before each replay, median µs).
`--sweep` also times every candidate config of `indexer.SWEEP` on a few shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List

from v4flash_kernels.kit.device import num_sms
from v4flash_kernels.kit.measure import time_graph
from v4flash_kernels.provenance import measured_commit

REL_TOL = 1e-3  # max |err| over valid positions / max |logit| of the call
BW_H200 = 4.3e12  # measured D2D copy bandwidth (bytes/s), as in bench.py
SWEEP_SHAPES = ((1, "128K", "4K"), (1, "1M", "128K"), (16, "1M", "4K"), (16, "128K", "128K"),
                (64, "128K", "128K"), (64, "1M", "4K"))


def parse_tokens(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    return int(t[:-1] if t[-1:] in "KM" else t) * mult


@dataclass(frozen=True)
class Shape:
    batch: int
    context: str  # configured context (tokens), e.g. "1M"
    actual: str  # actual length (tokens) or "full"

    @property
    def width(self) -> int:
        return parse_tokens(self.context) // 256

    @property
    def c4_len(self) -> int:
        ctx = parse_tokens(self.context)
        return (ctx if self.actual == "full" else min(ctx, parse_tokens(self.actual))) // 4


def shapes_for(batches: List[int], contexts: List[str], actuals: List[str]) -> List[Shape]:
    """Every (B, context, actual) with actual <= context; "full" is dropped where it repeats one."""
    out = []
    for b in batches:
        for c in contexts:
            seen = set()
            for a in actuals:
                sh = Shape(b, c, a)
                if a != "full" and parse_tokens(a) > parse_tokens(c):
                    continue
                if sh.c4_len in seen:
                    continue
                seen.add(sh.c4_len)
                out.append(sh)
    return out


def bytes_moved(shape: Shape, heads: int = 64) -> int:
    """Key bytes of the valid pages + the fp32 output row + q/weights/table (the floor's numerator)."""
    pages = math.ceil(shape.c4_len / 64)
    msl = shape.width * 64
    return shape.batch * (pages * 8448 + msl * 4 + heads * (128 + 4) + shape.width * 4)


def check(out: Any, ref: Any, other: Any = None) -> Dict[str, Any]:
    from v4flash_kernels.indexer.reference import logits_error

    e = logits_error(out, ref)
    res = {"rel_err": e["rel_err"], "inf_ok": e["inf_ok"], "nan": e["nan"]}
    res["ok"] = (not e["nan"]) and e["inf_ok"] and e["rel_err"] <= REL_TOL
    if other is not None:
        import torch

        res["vs_upstream"] = logits_error(out, other.to(torch.float64))["rel_err"]
    return res


def run_shape(shape: Shape, upstream: Any, seed: int, sweep: bool, device: str = "cuda", config: Any = None) -> Dict[str,
              Any]:
    """One shape: ours with `config` (default: the shipped one), w/o tail, upstream; `sweep`: SWEEP only."""
    import torch

    row = _measure_shape(shape, upstream, seed, sweep, device, config)
    if device == "cuda":  # the shape's tensors went with _measure_shape's frame
        torch.cuda.empty_cache()
    return row


def _measure_shape(shape: Shape, upstream: Any, seed: int, sweep: bool, device: str, config: Any) -> Dict[str, Any]:
    import torch

    from v4flash_kernels.indexer import op as indexer
    from v4flash_kernels.indexer.reference import IndexerCase, make_indexer_inputs, reference_for

    cfg_main = config or indexer.DEFAULT
    case = IndexerCase(batch=shape.batch, width=shape.width, lengths=[shape.c4_len])
    kw = make_indexer_inputs(case, device=device, seed=seed)
    args = list(kw.values())
    ref = reference_for(kw)
    B, msl = shape.batch, kw["max_seq_len"]
    nbytes = bytes_moved(shape)
    sms = num_sms(kw["q_fp8"].device)
    row = dict(asdict(shape), c4_len=shape.c4_len, max_seq_len=msl, bytes=nbytes,
               floor_h200_us=nbytes / BW_H200 * 1e6, config=cfg_main.name,
               nprog=indexer.programs_per_row(B, shape.width, sms, cfg_main), variants={})

    def ours_fn(cfg: Any, out: Any = None, max_seq_len: Any = msl, nprog: Any = None) -> Any:
        return lambda: indexer.run(kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["seq_lens"],
                                   kw["page_table"], max_seq_len, config=cfg, nprog=nprog, out=out)

    def checked(cfg: Any, other: Any = None) -> Dict[str, Any]:
        poison = torch.full((B, msl), float("nan"), dtype=torch.float32, device=device)
        res = check(ours_fn(cfg, out=poison)(), ref, other)
        del poison
        return res

    if sweep:
        for cfg in indexer.SWEEP:
            res = checked(cfg)
            res["us"] = time_graph(ours_fn(cfg), rep_ms=40) if res["ok"] else float("nan")
            row["variants"][f"cfg:{cfg.name}"] = res
    else:
        up_out = None
        if upstream is not None:
            up_out = upstream.fp8_paged_mqa_logits_torch_sm120(*args)
            row["variants"]["upstream"] = check(up_out, ref)
        row["variants"]["ours"] = checked(cfg_main, up_out)
        pub = indexer.fp8_paged_mqa_logits(*args)
        row["variants"]["ours"]["public_entry_ok"] = check(pub, ref)["ok"]
        del pub
        row["variants"]["ours"]["us"] = time_graph(ours_fn(cfg_main))
        # Every row has length c4_len: cut there (rounded up to a tile) nothing is left to fill.
        cut = min(msl, math.ceil(shape.c4_len / (cfg_main.pages * indexer.PAGE)) * cfg_main.pages * indexer.PAGE)
        row["variants"]["ours_no_tail"] = {"ok": True, "us": time_graph(ours_fn(cfg_main, max_seq_len=cut,
                                                                              nprog=row["nprog"]))}
        if upstream is not None:
            row["variants"]["upstream"]["us"] = time_graph(lambda: upstream.fp8_paged_mqa_logits_torch_sm120(*args))
        del up_out
    return row


def sweep_winner(rows: List[Dict[str, Any]]) -> str | None:
    """The SWEEP config with the lowest geometric-mean time over the sweep shapes (all checks ok)."""
    best = None
    names = [k for k in rows[0]["variants"] if k.startswith("cfg:")] if rows else []
    for n in names:
        us = [r["variants"][n]["us"] for r in rows]
        if not all(r["variants"][n]["ok"] for r in rows) or any(u != u for u in us):
            continue
        gm = math.exp(sum(math.log(u) for u in us) / len(us))
        if best is None or gm < best[0]:
            best = (gm, n[4:])
    return best[1] if best else None



def format_table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'B':>3} {'context':>7} {'actual':>6} {'c4 len':>7} {'floorH200':>9} {'ours':>8} {'no-tail':>8} "
            f"{'upstream':>9} {'x_up':>6} {'err':>8} {'vs_up':>8}  check")
    lines = [head, "-" * len(head)]
    for r in rows:
        v = r["variants"]
        o = v["ours"]
        up = v.get("upstream", {}).get("us", float("nan"))
        bad = [k for k, x in v.items() if not x.get("ok", True)]
        lines.append(
            f"{r['batch']:>3} {r['context']:>7} {r['actual']:>6} {r['c4_len']:>7} {r['floor_h200_us']:>9.2f} "
            f"{o['us']:>8.1f} {v['ours_no_tail']['us']:>8.1f} {up:>9.1f} {up / o['us']:>6.1f} "
            f"{o['rel_err']:>8.1e} {o.get('vs_upstream', float('nan')):>8.1e}  "
            + ("ok" if not bad else "FAIL:" + ",".join(bad))
        )
    return "\n".join(lines)


def format_sweep(rows: List[Dict[str, Any]]) -> str:
    swept = [r for r in rows if any(k.startswith("cfg:") for k in r["variants"])]
    if not swept:
        return ""
    names = [k for k in swept[0]["variants"] if k.startswith("cfg:")]
    cols = [f"B{r['batch']}/{r['context']}/{r['actual']}" for r in swept]
    head = f"{'config':<18}" + "".join(f"{c:>17}" for c in cols) + f"{'geomean':>10}"
    lines = [head, "-" * len(head)]
    scored = []
    for n in names:
        us = [r["variants"][n]["us"] for r in swept]
        gm = math.exp(sum(math.log(u) for u in us) / len(us)) if all(u == u for u in us) else float("nan")
        scored.append((gm, n, us))
    for gm, n, us in sorted(scored, key=lambda x: (x[0] != x[0], x[0])):
        lines.append(f"{n[4:]:<18}" + "".join(f"{u:>17.1f}" for u in us) + f"{gm:>10.1f}")
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    lines = [
        "| B | configured context | actual | c4 positions | floor H200 | **ours** | ours w/o -inf tail | upstream "
        "| upstream / ours | rel. err vs fp64 | vs upstream | programs / row |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["variants"]
        o = v["ours"]
        up = v.get("upstream", {}).get("us", float("nan"))
        ok = "" if o["ok"] else " FAIL"
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['actual']} | {r['c4_len']} | {r['floor_h200_us']:.1f} | "
            f"**{o['us']:.1f}** | {v['ours_no_tail']['us']:.1f} | {up:.0f} | {up / o['us']:.0f}x | "
            f"{o['rel_err']:.1e}{ok} | {o.get('vs_upstream', float('nan')):.1e} | {r['nprog']} |"
        )
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.indexer", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="128K,1M")
    ap.add_argument("--actual", default="4K,64K,128K,full")
    ap.add_argument("--sweep", action="store_true", help="also time indexer.SWEEP on the sweep shapes")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the markdown table (for kernels/BENCH.md)")
    ap.add_argument("--seed", type=int, default=None, help="default: fresh random inputs each run")
    args = ap.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("bench_indexer needs a CUDA GPU", file=sys.stderr)
        return 2
    upstream = None
    if not args.no_upstream:
        from v4flash_kernels.upstream import load_indexer

        upstream = load_indexer()
    from v4flash_kernels.indexer import op as indexer

    shapes = shapes_for([int(b) for b in args.batches.split(",")], args.contexts.split(","), args.actual.split(","))
    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    rows: List[Dict[str, Any]] = []
    sweep_rows: List[Dict[str, Any]] = []
    failed: List[Dict[str, Any]] = []
    t0 = time.time()

    def dump(partial: bool, meta: Dict[str, Any]) -> None:
        if args.json:  # rewritten after every shape so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"meta": dict(meta, partial=partial), "rows": rows, "sweep": sweep_rows, "failed": failed}, f,
                          indent=1)

    def one(sh: Shape, i: int, sweep: bool, config: Any = None) -> Dict[str, Any] | None:
        try:
            return run_shape(sh, upstream, seed + i, sweep, config=config)
        except Exception as exc:  # one broken shape must not lose the others' rows
            import traceback

            traceback.print_exc()
            failed.append(dict(asdict(sh), sweep=sweep, error=f"{type(exc).__name__}: {exc}"))
            torch.cuda.empty_cache()
            return None

    chosen = indexer.DEFAULT
    if args.sweep:
        for i, (b, c, a) in enumerate(SWEEP_SHAPES):
            r = one(Shape(b, c, a), 1000 + i, True)
            if r is not None:
                sweep_rows.append(r)
                print(f"[{time.time() - t0:6.1f}s] sweep B={b} ctx={c} actual={a} done", flush=True)
            dump(True, {"seed": seed})
        win = sweep_winner(sweep_rows)
        if win is not None:
            chosen = next(c for c in indexer.SWEEP if c.name == win)
        print(f"sweep winner (geomean over the sweep shapes): {win}; main table uses {chosen.name}", flush=True)
    for i, sh in enumerate(shapes):
        r = one(sh, i, False, chosen)
        if r is None:
            continue
        rows.append(r)
        dump(True, {"seed": seed, "config": chosen.name})
        v = r["variants"]
        print(f"[{time.time() - t0:6.1f}s] B={sh.batch} ctx={sh.context} actual={sh.actual}: ours "
              f"{v['ours']['us']:.1f} us (no tail {v['ours_no_tail']['us']:.1f}) err {v['ours']['rel_err']:.1e}"
              + (f", upstream {v['upstream']['us']:.1f} us" if "upstream" in v else ""), flush=True)
    props = torch.cuda.get_device_properties(0)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed,
            "upstream_origin": getattr(upstream, "__v4flash_origin__", None), "config": chosen.name}
    print(json.dumps(meta))
    print(format_table(rows))
    sw = format_sweep(sweep_rows)
    if sw:
        print("\nconfig sweep (us, graph replay; geomean over these shapes picks the main table's config):\n" + sw)
    dump(False, meta)
    if args.md:
        with open(args.md, "w") as f:
            f.write(format_markdown(rows) + "\n")
    for f_ in failed:
        print(f"FAILED shape: {f_}")
    all_ok = not failed and all(x.get("ok", True) for r in rows + sweep_rows for x in r["variants"].values())
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
