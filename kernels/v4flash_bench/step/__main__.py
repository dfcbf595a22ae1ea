"""python -m v4flash_bench.step: one DeepSeek-V4-Flash decode step (and prefill chunk) of one TP4 GPU, op by op.

    python -m v4flash_bench.step [--dry-run] [--json out.json] [--md out.md]
        [--batches 1,16,32,64] [--contexts 128K,1M] [--actual-context 8K] [--prefill 1K,8K]

Upstream's sm_120 code is loaded from the pinned sglang wheel at run time; ours wherever a patch
exists. Every distinct shape is checked against a reference, then timed once under CUDA-graph
replay with L2 flushed, and the per-op µs x layer counts are composed into ms per step, tok/s
and prefill seconds, next to the bytes/FLOPs floor on one RTX PRO 6000 and on this GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

from v4flash_bench.step import model as M
from v4flash_bench.step import report as R
from v4flash_kernels.provenance import measured_commit

DEFAULT_SEED = 20261202  # fixed: two runs draw the same inputs unless --seed says otherwise
DEFAULT_TP = "4,2"
DEFAULT_MTP = "1,2,3"
DEFAULT_VERIFY_BATCHES = "1,16,64"
RUNS_BEFORE_OPT_IN = "qnorm_rope"  # what a run's JSON without meta["opt_in"] composed


class UsageError(Exception):
    def __init__(self, msg: str, fix: str) -> None:
        super().__init__(msg)
        self.fix = fix


def parse_sizes(text: str, what: str) -> List[int]:
    """'1,16' / '128K,1M' -> ints (K = 1024, M = 1048576)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        mult = 1
        if part[-1] in "kK":
            mult, part = 1024, part[:-1]
        elif part[-1] in "mM":
            mult, part = 1 << 20, part[:-1]
        try:
            v = int(part) * mult
        except ValueError:
            raise UsageError(f"--{what} {text!r}: {part!r} is not a number",
                             f"give e.g. --{what} 1,16 or 128K,1M") from None
        if v <= 0:
            raise UsageError(f"--{what} {text!r}: sizes must be positive", f"give e.g. --{what} 1,16")
        out.append(v)
    if not out:
        raise UsageError(f"--{what} is empty", f"give at least one size, e.g. --{what} 1")
    return out


def heads_patched(tp: int = M.TP) -> int:
    """64/TP when our sparse-decode patch slices this rank's heads (its registry entry has an
    adapter that passes the attention-TP rank); otherwise the patch also attends all 64."""
    try:
        from v4flash_kernels.hook.patches import SPARSE_DECODE
    except Exception:
        return M.N_HEADS
    return M.N_HEADS // tp if getattr(SPARSE_DECODE, "adapter", None) else M.N_HEADS


def _names(text: str) -> Tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))


def parse_opt_in(text: str, lenient: bool = False) -> Tuple[str, ...]:
    """'qnorm_rope' -> the switches, off in `up`'s default plan, whose patches the patched path runs
    anyway ('' = none: the patched path is what ships by default). `lenient` (a finished run's own
    list): a switch that has become on by default since is dropped, the default composes it anyway."""
    from v4flash_kernels.hook.patches import SWITCHES

    off = [s.name for s in SWITCHES if not s.default_on]
    known = {s.name for s in SWITCHES}
    out = []
    for name in _names(text):
        if name in off:
            out.append(name)
        elif not (lenient and name in known):
            on = "is on by default already" if name in known else "is not a kernel switch"
            raise UsageError(f"--opt-in {text!r}: {name!r} {on}",
                             f"name switches that are off by default: {', '.join(off) or '(none)'}; '' = none")
    return tuple(out)


def specs_from(args: Any) -> List[M.StepSpec]:
    batches = parse_sizes(args.batches, "batches")
    contexts = parse_sizes(args.contexts, "contexts")
    actual = parse_sizes(args.actual_context, "actual-context")[0]
    chunks = parse_sizes(args.prefill, "prefill") if args.prefill else []
    too_big = [c for c in chunks if c > M.PREFILL_EXTEND_ROWS_MAX]
    if too_big:
        raise UsageError(f"--prefill {too_big[0]}: chunks above {M.PREFILL_EXTEND_ROWS_MAX} tokens leave the sm_120 "
                         "extend path this bench models", f"use chunks <= {M.PREFILL_EXTEND_ROWS_MAX}, e.g. 1K,8K")
    tps = parse_sizes(args.tp or DEFAULT_TP, "tp")
    bad = [t for t in tps if t not in (2, 4)]
    if bad:
        raise UsageError(f"--tp {args.tp}: {bad[0]} is not a modelled layout", "give --tp 4, --tp 2 or --tp 4,2")
    first, others = tps[0], list(dict.fromkeys(tps[1:]))
    opt = parse_opt_in(args.opt_in or "")
    h = heads_patched(first)
    specs = M.decode_specs(batches, contexts, actual, h, first, opt) + M.prefill_specs(chunks, h, first, opt)
    mtp = args.mtp if args.mtp is not None else DEFAULT_MTP
    if mtp.strip():
        ks = parse_sizes(mtp, "mtp")
        if any(k > 7 for k in ks):
            raise UsageError(f"--mtp {mtp}: up to 7 draft tokens are modelled", "give e.g. --mtp 1,2,3")
        vb = parse_sizes(args.verify_batches or DEFAULT_VERIFY_BATCHES, "verify-batches")
        specs += M.verify_specs(vb, ks, contexts[0], actual, h, first, opt)
    for tp in others:  # the other layouts: decode at the first context, for the per-GPU comparison
        specs += M.decode_specs(batches, contexts[:1], actual, heads_patched(tp), tp, opt)
    return specs



def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.step", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,32,64", help="decode requests per GPU")
    ap.add_argument("--contexts", default="128K,1M", help="configured --context-length values")
    ap.add_argument("--actual-context", default="8K", help="tokens already in each decoding request")
    ap.add_argument("--prefill", default="1K,8K", help="prefill chunk sizes (tokens of one request); '' = none")
    ap.add_argument("--tp", default=None, help="attention/MoE TP of a worker: the first gets every composition, "
                    "the others decode at the first context (per-GPU TP4 vs 2x TP2 table); default 4,2 "
                    "(with --from-json: the run's)")
    ap.add_argument("--mtp", default=None, help="draft tokens k of the verify-step compositions (MTP speculative "
                    f"decoding), at the first context and TP; '' = none; default {DEFAULT_MTP}")
    ap.add_argument("--verify-batches", default=None, help=f"requests per GPU of the verify compositions; default "
                    f"{DEFAULT_VERIFY_BATCHES}")
    ap.add_argument("--opt-in", default=None, help="switches off in up's default plan whose patches the patched path "
                    "runs anyway, e.g. qnorm_rope (labels get '+name'); default none: the patched path is what "
                    "ships (with --from-json: the run's)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan of ops and shapes; no GPU needed")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="write the markdown tables (for docs/decode-step.md)")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED,
                    help=f"every op's inputs derive from it and the op's key (default {DEFAULT_SEED}); a verdict "
                    "must not depend on it")
    ap.add_argument("--from-json", default=None, help="re-render a finished run's --json (no GPU needed)")
    ap.add_argument("--no-step-graph", action="store_true",
                    help="skip capturing each decode step (first TP and context) as one CUDA graph")
    args = ap.parse_args(argv)
    try:
        specs = specs_from(args)
    except UsageError as exc:
        print(f"error: {exc}\nfix: {exc.fix}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(R.plan_text(specs))
        return 0
    if args.from_json:
        return from_json(args.from_json, args)

    try:
        import torch
    except ImportError:
        print("error: torch is not installed, so no op can run.\nfix: run on the GPU machine (torch + triton), "
              "or pass --dry-run to print the plan only.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA GPU is visible to torch; the step bench times kernels on a GPU.\n"
              "fix: run it on a machine with an NVIDIA GPU (check `nvidia-smi` and CUDA_VISIBLE_DEVICES), "
              "or pass --dry-run to print the plan only.", file=sys.stderr)
        return 2
    import triton

    from v4flash_bench.step import runner
    from v4flash_kernels.kit.measure import copy_bandwidth, graph_overhead_us

    seed = args.seed
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    gpu = M.machine_for(props.name, bw)
    overhead = graph_overhead_us()
    print(f"GPU {props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MB, "
          f"copy {bw / 1e12:.2f} TB/s, one-kernel graph replay {overhead:.1f} us", flush=True)
    print(f"seed {seed} (--seed): every op's inputs derive from it and the op's key", flush=True)
    t0 = time.time()
    ops, meas = runner.run(specs, seed, log=lambda s: print(s, flush=True))
    graphs = [] if args.no_step_graph else step_graphs(specs, meas, seed, lambda s: print(s, flush=True))
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
        "sms": props.multi_processor_count, "l2_mb": props.L2_cache_size >> 20, "copy_bw_tbs": bw / 1e12,
        "graph_overhead_us": overhead, "torch": torch.__version__, "triton": triton.__version__,
        "commit": measured_commit(), "argv": sys.argv[1:], "seed": seed,
        "wall_s": time.time() - t0, "heads_patched": specs[0].heads_patched if specs else None,
        "tp": args.tp or DEFAULT_TP, "mtp": DEFAULT_MTP if args.mtp is None else args.mtp,
        "verify_batches": args.verify_batches or DEFAULT_VERIFY_BATCHES, "opt_in": args.opt_in or "",
        "wheel": os.environ.get("V4FLASH_SGLANG_WHEEL"),
    }
    return emit(specs, meas, gpu, meta, args, graphs)


def step_graphs(specs: List[M.StepSpec], meas: Dict[Tuple[str, str], Any], seed: int,
                log: Callable[[str], None]) -> List[Any]:
    """Each decode step of the first TP and context, both paths, captured whole (`stepgraph`)."""
    import torch

    from v4flash_bench.step import stepgraph

    decode = [s for s in specs if s.phase == "decode"]
    if not decode:
        return []
    first = decode[0]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    out = []
    for s in decode:
        if s.tp != first.tp or s.configured_ctx != first.configured_ctx:
            continue
        for path in ("upstream", "patched"):
            g = stepgraph.measure(s, path, meas, seed, l2)
            log(f"step graph {s.label} {path}: " + (f"{g.ms:.2f} ms, {g.kernels} kernels" if g.error is None
                                                     else g.error))
            out.append(g)
    return out


def emit(specs: List[M.StepSpec], meas: Dict[Tuple[str, str], Any], gpu: M.Machine, meta: Dict[str, Any], args: Any,
         graphs: List[Any] | None = None) -> int:
    """Compose every spec from the measurements, print the tables, write JSON / markdown; 1 on a failed op."""
    from v4flash_bench.step import results as runner

    graphs = graphs or []
    pairs = []
    kernels = {}
    for s in specs:
        sops = M.step_ops(s)
        us, src = runner.path_times(sops, meas)
        pairs.append((M.compose(s, "upstream", sops, us, src, gpu), M.compose(s, "patched", sops, us, src, gpu)))
        for path in ("upstream", "patched"):
            kernels[(s.label, path)] = runner.kernels_per_step(sops, path, meas)
    print(json.dumps(meta))
    print()
    print(R.summary_table(pairs, md=False, kernels=kernels))
    graph_text = R.step_graph_table(graphs, pairs, kernels, md=False)
    if graph_text:
        print("\nthe step as it runs: every call of the decode step in one CUDA graph, next to the per-op sum")
        print(graph_text)
    spec_text = R.spec_table(pairs, md=False)
    if spec_text:
        print("\nspeculative decoding (MTP): verify cycle = B x (k+1)-row target forward + k draft forwards "
              "(patched path)")
        print(spec_text)
    tp_text = R.tp_table(pairs, md=False)
    if tp_text:
        print("\nper GPU: one TP4 decode worker vs two TP2 decode workers on the same 4 GPUs (patched path)")
        print(tp_text)
    for up, pa in pairs:
        print(f"\n== {up.spec.label}")
        print(R.composition_table(up, pa, gpu, md=False))
    bad = [m for m in meas.values() if not m.ok]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "meta": meta,
                "measurements": [runner.to_json(m) for m in meas.values()],
                "step_graphs": [g.__dict__ for g in graphs],
                "kernels_per_step": [{"spec": k[0], "path": k[1], "kernels": v} for k, v in kernels.items()],
                "compositions": [{
                    "spec": up.spec.label, "upstream_ms": up.total_ms, "patched_ms": pa.total_ms,
                    "upstream_timed_ms": up.timed_ms, "patched_timed_ms": pa.timed_ms,
                    "estimate_ms": up.estimate_ms, "floor_rtx6000_ms": pa.floor_rtx_ms, "floor_gpu_ms": pa.floor_gpu_ms,
                    "upstream_tok_s": up.tok_s(), "patched_tok_s": pa.tok_s(),
                    "complete": not (up.failed or pa.failed), "failed": {"upstream": list(up.failed),
                                                                         "patched": list(pa.failed)},
                    "lines": [dict(path=c.path, **ln.__dict__) for c in (up, pa) for ln in c.lines],
                } for up, pa in pairs],
            }, f, indent=1, default=str)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"<!-- {json.dumps(meta)} -->\n\n## Summary\n\n{R.summary_table(pairs, md=True, kernels=kernels)}\n")
            if graph_text:
                f.write(f"\n## The step as it runs (one CUDA graph per decode step)\n\n"
                        f"{R.step_graph_table(graphs, pairs, kernels, md=True)}\n")
            if tp_text:
                f.write(f"\n## TP4 vs 2x TP2 (per GPU, patched path)\n\n{R.tp_table(pairs, md=True)}\n")
            if spec_text:
                f.write(f"\n## Speculative decoding (MTP verify cycles, patched path)\n\n"
                        f"{R.spec_table(pairs, md=True)}\n")
            for up, pa in pairs:
                f.write(f"\n### {up.spec.label}\n\n{R.composition_table(up, pa, gpu, md=True)}\n")
    if bad:
        print("\nFAILED (mismatch vs reference or error):", file=sys.stderr)
        for m in bad:
            print(f"  {m.impl} {m.key}: {m.error}", file=sys.stderr)
        return 1
    return 0


def from_json(path: str, args: Any) -> int:
    """Re-compose and re-render a finished run's measurements (no GPU, no torch): same specs, new tables."""
    from v4flash_bench.step import results as runner

    try:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        meas = {(m["key"], m["impl"]): runner.Measurement(**m) for m in data["measurements"]}
        from v4flash_bench.step.stepgraph import StepGraph

        graphs = [StepGraph(**g) for g in data.get("step_graphs", ())]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: cannot read measurements from {path}: {exc}\nfix: pass the --json file a GPU run wrote",
              file=sys.stderr)
        return 2
    if args.tp is None:
        args.tp = meta.get("tp") or "4"  # runs before --tp existed modelled TP4 only
    if args.mtp is None:
        args.mtp = meta.get("mtp", "")  # runs before --mtp existed had no verify compositions
    if args.verify_batches is None:
        args.verify_batches = meta.get("verify_batches")
    try:
        # The run's composition: runs before --opt-in existed composed every patch the bench knew, the
        # fused q path included. Its graphs are labelled with the names it was given (none before
        # --opt-in); they are relabelled as that composition is labelled today.
        run_names = parse_opt_in(meta.get("opt_in", RUNS_BEFORE_OPT_IN), lenient=True)
        given = M.opt_in_suffix(_names(meta.get("opt_in", "")))
        graphs = [dataclasses.replace(g, spec=g.spec.removesuffix(given) + M.opt_in_suffix(run_names))
                  for g in graphs]
        if args.opt_in is None:
            args.opt_in = ",".join(run_names)
        specs = specs_from(args)
        wanted = parse_opt_in(args.opt_in)
    except UsageError as exc:
        print(f"error: {exc}\nfix: {exc.fix}", file=sys.stderr)
        return 2
    if wanted != run_names and graphs:
        print(f"note: the run's whole-step graphs captured its own composition (--opt-in {','.join(run_names)!r}); "
              f"they are left out of a re-render with --opt-in {args.opt_in!r}", file=sys.stderr)
        graphs = []
    if meta.get("heads_patched") is not None and meta["heads_patched"] == M.N_HEADS:  # a run without the adapter
        specs = [dataclasses.replace(s, heads_patched=M.N_HEADS) for s in specs]
    gpu = M.machine_for(meta["gpu"], meta["copy_bw_tbs"] * 1e12)
    try:
        return emit(specs, meas, gpu, meta, args, graphs)
    except KeyError as exc:
        print(f"error: the run in {path} has no measurement for {exc}\nfix: give the same --batches/--contexts/"
              "--actual-context/--prefill/--tp/--opt-in as that run (its argv is in the JSON's meta)", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
