"""Benchmark of the top-512 transform: check against the exact reference, then time under CUDA-graph replay.

    python -m v4flash_bench.topk [--json out.json] [--batches 1,16,64] [--contexts 128K,1M]
        [--actual 8K,32K,full] [--prefill 1K,8K] [--sweep]

Shapes are one c4 layer's call as SGLang makes it: decode rows of a configured context C tokens
have C/4 scores (the logits' width) of which L/4 are valid for an actual length L (the rest -inf, as
the indexer writes them), a page table of C/256 columns, page size 64; a prefill chunk of T tokens
has T rows, row t with (t+1)//4 valid of ceil(T/256)*64. Per shape: ours on poisoned outputs, exact
against the reference on up to 8 rows; then timed with `triton.testing.do_bench` on a captured CUDA
graph (L2 flushed before each replay, median µs) next to
- `proxy`: torch.topk over the valid prefix, what the step bench timed for upstream so far;
- `torch`: the wheel's `topk_transform_512_pytorch_vectorized` (SGLANG_TOPK_TRANSFORM_512_TORCH),
  checked against the reference as sets;
- `jit`: the real `sglang.jit_kernel.dsv4.topk_transform_512`, only where sglang and its JIT
  toolchain import (recorded as unavailable otherwise).
`--sweep` also times `op.SWEEP` on three shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Tuple

from v4flash_kernels.kit.measure import time_graph
from v4flash_kernels.provenance import measured_commit

K = 512
PAGE = 64
CHECK_ROWS = 8
SWEEP_SHAPES = (("decode", 1, "128K", "full"), ("decode", 1, "128K", "8K"), ("decode", 64, "128K", "full"))


def parse_tokens(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    return int(t[:-1] if t[-1:] in "KM" else t) * mult


@dataclass(frozen=True)
class Shape:
    kind: str  # "decode" | "prefill"
    batch: int  # decode requests, or the prefill chunk's tokens
    context: str  # configured context (decode) or the chunk ("prefill")
    actual: str  # actual length (decode) or "-"

    @property
    def width(self) -> int:
        if self.kind == "prefill":
            return -(-self.batch // 256) * PAGE
        return parse_tokens(self.context) // 4

    def lengths(self) -> List[int]:
        if self.kind == "prefill":
            return [(t + 1) // 4 for t in range(self.batch)]
        ctx = parse_tokens(self.context)
        actual = ctx if self.actual == "full" else min(ctx, parse_tokens(self.actual))
        return [actual // 4] * self.batch

    @property
    def label(self) -> str:
        return (f"prefill T={self.batch}" if self.kind == "prefill"
                else f"B={self.batch} ctx={self.context} actual={self.actual}")


def shapes_for(batches: List[int], contexts: List[str], actuals: List[str], prefill: List[str]) -> List[Shape]:
    out = []
    for c in contexts:
        for b in batches:
            seen = set()
            for a in actuals:
                if a != "full" and parse_tokens(a) > parse_tokens(c):
                    continue
                sh = Shape("decode", b, c, a)
                if sh.lengths()[0] in seen:
                    continue
                seen.add(sh.lengths()[0])
                out.append(sh)
    return out + [Shape("prefill", parse_tokens(t), t, "-") for t in prefill]


def make_inputs(shape: Shape, seed: int, device: str = "cuda") -> Dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    B, W = shape.batch, shape.width
    lens = torch.tensor(shape.lengths(), dtype=torch.int32, device=device)
    scores = torch.randn((B, W), generator=g, device=device)
    scores.masked_fill_(torch.arange(W, device=device)[None, :] >= lens[:, None], float("-inf"))
    cols = -(-W // PAGE)
    table = torch.randperm(B * cols, generator=g, device=device).to(torch.int32).view(B, cols)
    return {"scores": scores, "seq_lens": lens, "page_tables": table,
            "out_page_indices": torch.empty((B, K), dtype=torch.int32, device=device), "page_size": PAGE,
            "out_raw_indices": torch.empty((B, K), dtype=torch.int32, device=device)}


def _rows(B: int) -> List[int]:
    return sorted({0, B // 3, B // 2, B - 1} | set(range(min(B, CHECK_ROWS - 4))))[:CHECK_ROWS]


def check(kw: Dict[str, Any], exact: bool) -> Dict[str, Any]:
    """Outputs vs the reference on a few rows: exact (ours), or as per-row sets (other implementations)."""
    import torch

    from v4flash_kernels.topk.reference import topk_transform_ref

    rows = _rows(kw["scores"].shape[0])
    want_p, want_r = topk_transform_ref(kw["scores"][rows], kw["seq_lens"][rows], kw["page_tables"][rows], K, PAGE)
    got_p, got_r = kw["out_page_indices"][rows].cpu(), kw["out_raw_indices"][rows].cpu()
    if exact:
        ok = torch.equal(got_p, want_p) and torch.equal(got_r, want_r)
    else:
        def srt(t: torch.Tensor) -> torch.Tensor:
            return torch.sort(t, dim=1).values

        ok = torch.equal(srt(got_p), srt(want_p)) and torch.equal(srt(got_r), srt(want_r))
    return {"ok": bool(ok), "rows_checked": len(rows), "exact": exact}


def _jit() -> Tuple[Any, ...]:
    """(upstream's JIT function, None) or (None, why it is unavailable)."""
    try:
        from sglang.jit_kernel.dsv4 import topk_transform_512
    except Exception as exc:  # sglang (and its JIT toolchain) is not on the GPU bench box
        return None, f"unavailable: {type(exc).__name__}: {exc}"[:200]
    return topk_transform_512, None


def run_shape(shape: Shape, torch_version: Any, jit: Any, jit_why: Any, seed: int, configs: Any = None, device: str = "cuda",
              timer: Callable[..., float] = time_graph) -> Dict[str, Any]:
    """One shape: ours (or each of `configs`), checked then timed; without `configs` also the proxy,
    the wheel's torch version and the JIT kernel where they run."""
    import torch

    from v4flash_kernels.topk import op as topk

    kw = make_inputs(shape, seed, device)
    args = list(kw.values())
    lens = shape.lengths()
    row = dict(asdict(shape), label=shape.label, width=shape.width, max_valid=max(lens), variants={})

    def ours(cfg: Any) -> Any:
        return lambda: topk.run(**kw, config=cfg)

    for cfg in configs or (topk.DEFAULT,):
        kw["out_page_indices"].fill_(-7)
        kw["out_raw_indices"].fill_(-7)
        ours(cfg)()
        res = check(kw, exact=True)
        res["us"] = timer(ours(cfg)) if res["ok"] else float("nan")
        row["variants"]["ours" if configs is None else f"cfg:{cfg.name}"] = res
    if configs is not None:
        return row
    valid = max(lens)
    head = kw["scores"][:, :valid]
    k = min(K, valid)
    row["variants"]["proxy"] = {"ok": True, "us": timer(lambda: torch.topk(head, k, dim=1, largest=True, sorted=False))}
    if torch_version is not None:
        torch_version(*args)
        res = check(kw, exact=False)
        res["us"] = timer(lambda: torch_version(*args))
        row["variants"]["torch"] = res
    if jit is not None:
        try:
            jit(*args)
            res = check(kw, exact=False)
            res["us"] = timer(lambda: jit(*args))
        except Exception as exc:
            res = {"ok": True, "us": float("nan"), "why": f"failed: {type(exc).__name__}: {exc}"[:200]}
        row["variants"]["jit"] = res
    else:
        row["variants"]["jit"] = {"ok": True, "us": float("nan"), "why": jit_why}
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = f"{'shape':<34} {'valid':>6} {'ours':>8} {'proxy':>8} {'torch':>8} {'jit':>8} {'proxy/ours':>10}  check"
    lines = [head, "-" * len(head)]
    for r in rows:
        v = r["variants"]
        us = {n: v.get(n, {}).get("us", float("nan")) for n in ("ours", "proxy", "torch", "jit")}
        bad = [n for n, x in v.items() if not x.get("ok", True)]
        lines.append(f"{r['label']:<34} {r['max_valid']:>6} {us['ours']:>8.2f} {us['proxy']:>8.2f} {us['torch']:>8.2f} "
                     f"{us['jit']:>8.2f} {us['proxy'] / us['ours']:>10.1f}  "
                     + ("ok" if not bad else "FAIL:" + ",".join(bad)))
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.topk", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="128K,1M")
    ap.add_argument("--actual", default="8K,32K,full")
    ap.add_argument("--prefill", default="1K,8K", help="prefill chunk sizes (tokens); '' for none")
    ap.add_argument("--sweep", action="store_true", help="also time op.SWEEP on three shapes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=None, help="default: fresh random inputs each run")
    args = ap.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("the top-k bench needs a CUDA GPU", file=sys.stderr)
        return 2
    from v4flash_kernels.topk import op as topk
    from v4flash_kernels.upstream import load_indexer

    torch_version = load_indexer().topk_transform_512_pytorch_vectorized
    jit, jit_why = _jit()
    contexts = args.contexts.split(",")
    shapes = shapes_for([int(b) for b in args.batches.split(",")], contexts[:1], args.actual.split(","),
                        [p for p in args.prefill.split(",") if p])
    shapes += [Shape("decode", 1, c, a) for c in contexts[1:] for a in ("8K", "full")]  # B=1 only past the first
    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    rows: List[Dict[str, Any]] = []
    sweep_rows: List[Dict[str, Any]] = []
    failed: List[Dict[str, Any]] = []
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed, "config": topk.DEFAULT.name, "k": K,
            "jit": jit_why or "sglang.jit_kernel.dsv4.topk_transform_512"}

    def dump(partial: bool) -> None:
        if args.json:  # rewritten after every shape so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"meta": dict(meta, partial=partial), "rows": rows, "sweep": sweep_rows, "failed": failed},
                          f, indent=1)

    def one(sh: Shape, i: int, configs: Any = None) -> Dict[str, Any] | None:
        try:
            return run_shape(sh, torch_version, jit, jit_why, seed + i, configs)
        except Exception as exc:  # one broken shape must not lose the others' rows
            import traceback

            traceback.print_exc()
            failed.append(dict(asdict(sh), error=f"{type(exc).__name__}: {exc}"))
            torch.cuda.empty_cache()
            return None

    for i, sh in enumerate(shapes):
        r = one(sh, i)
        if r is not None:
            rows.append(r)
            v = r["variants"]
            print(f"[{time.time() - t0:6.1f}s] {sh.label}: ours {v['ours']['us']:.2f} us, proxy {v['proxy']['us']:.2f},"
                  f" torch {v.get('torch', {}).get('us', float('nan')):.2f}", flush=True)
        dump(True)
    if args.sweep:
        for i, (kind, b, c, a) in enumerate(SWEEP_SHAPES):
            r = one(Shape(kind, b, c, a), 1000 + i, topk.SWEEP + (topk.DEFAULT,))
            if r is not None:
                sweep_rows.append(r)
            dump(True)
    print(json.dumps(meta))
    print(format_table(rows))
    for r in sweep_rows:
        print(f"sweep {r['label']}: " + ", ".join(f"{n[4:]} {x['us']:.2f}" for n, x in r["variants"].items()))
    dump(False)
    for f_ in failed:
        print(f"FAILED shape: {f_}")
    all_ok = not failed and all(x.get("ok", True) for r in rows + sweep_rows for x in r["variants"].values())
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
