"""Check and time the IPC all-reduce against NCCL: one process per GPU (no torchrun), or one GPU simulated.

    python -m v4flash_bench.allreduce [--json out.json] [--worlds 2,4] [--sizes 2,16384,65536,...]
        [--dtype bf16] [--calls 20] [--reps 7]
    python -m v4flash_bench.allreduce --simulate [--json out.json]      # one GPU, N ranks on N streams

Multi-GPU (the default where >= 2 GPUs are visible; with one GPU it runs `--simulate` and says so):
for each world size (default 2..GPUs) it spawns one process per GPU, sets up torch.distributed
(NCCL) plus a gloo group and the communicator exactly as SGLang's hook does (IPC set-up and the
start-up probe included; a fall-back is reported, not hidden), then per message size
* checks ours, eagerly and replayed from a CUDA graph, against NCCL and the exact sum (integer-valued
  inputs: every sum is exact, so ours, NCCL and the fp64 reference must agree bit for bit, on every rank),
* times ours in a CUDA graph (`calls` all-reduces per replay, median of `reps` replays; the auto plan and,
  where both fit, one-shot and two-shot forced, to set `plan.ONE_SHOT_MAX` from data) and NCCL eagerly
  and, where torch can capture it, in a CUDA graph; the slowest rank's time counts.
`--simulate` runs the kernels of N ranks on one GPU (`simulate.LocalRanks`): the protocol's cost
without a link, for the single-GPU machine; its numbers are not a box's all-reduce time.

`measure(world, sizes)` is the entry for other benches (the step bench's all-reduce row): µs per
all-reduce of each size, ours and NCCL, on this machine, with the link named (`link_label`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Sequence

KB, MB = 1024, 1024 * 1024
SIZES = (2, 16, 256, 4 * KB, 16 * KB, 32 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 8 * MB)
CALLS = 20
REPS = 7


@dataclass
class SizeResult:
    nbytes: int
    plan: str = ""
    correct: bool | None = None  # ours (eager and graph) == NCCL == exact, identical on every rank
    detail: str = ""
    ours_us: float | None = None  # auto plan, CUDA graph
    one_shot_us: float | None = None
    two_shot_us: float | None = None
    nccl_us: float | None = None  # eager
    nccl_graph_us: float | None = None


@dataclass
class WorldResult:
    world: int
    active: bool = False
    reason: str = ""
    probe: str = ""
    sizes: List[SizeResult] = field(default_factory=list)
    error: str = ""


# ----------------------------------------------------------------------------- per rank


def _exact_input(numel: int, rank: int, dtype: Any, device: Any) -> Any:
    import torch

    i = torch.arange(numel, device=device, dtype=torch.int64)
    return ((i * 5 + rank * 11) % 23 - 11).to(dtype)


def _time(run: Any, calls: int, reps: int) -> float:
    import torch

    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0 / calls)
    return float(sorted(ts)[len(ts) // 2])


def _graph(fn: Any, calls: int) -> Any:
    import torch

    fn()  # warm (compiles outside capture)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def _rank_sizes(comm: Any, rank: int, world: int, sizes: Sequence[int], dtype: Any, calls: int, reps: int,
                timing: bool) -> List[Dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from v4flash_kernels.allreduce import plan as P
    from v4flash_kernels.allreduce.launch import launch
    from v4flash_kernels.allreduce.reference import all_reduce_ref

    dev = comm.device
    esize = torch.empty(0, dtype=dtype).element_size()
    out: List[Dict[str, Any]] = []
    for nbytes in sizes:
        numel = max(1, nbytes // esize)
        r: Dict[str, Any] = {"nbytes": numel * esize}
        if not comm.should(torch.empty(numel, dtype=dtype, device=dev)):
            r["detail"] = "not taken by the communicator (NCCL)"
            out.append(r)
            continue
        r["plan"] = P.plan(numel, esize, world, comm.layout).name
        x = _exact_input(numel, rank, dtype, dev)
        exact = all_reduce_ref([_exact_input(numel, s, dtype, dev) for s in range(world)]).to(dtype)
        nccl = x.clone()
        dist.all_reduce(nccl)
        eager = comm.all_reduce(x)
        gout = torch.empty_like(x)
        g = _graph(lambda: comm.all_reduce(x, gout), 1)  # noqa: B023 - used before the next iteration
        gout.zero_()
        g.replay()
        torch.cuda.synchronize()
        digest = hashlib.sha256(eager.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()  # same on every rank?
        ok = bool(torch.equal(eager, exact) and torch.equal(gout, exact) and torch.equal(nccl, exact))
        r["ok"], r["digest"] = ok, digest
        if not ok:
            r["detail"] = (f"eager==exact {torch.equal(eager, exact)}, graph==exact {torch.equal(gout, exact)}, "
                           f"nccl==exact {torch.equal(nccl, exact)}")
        if timing:
            y = torch.empty_like(x)
            g = _graph(lambda: comm.all_reduce(x, y), calls)  # noqa: B023
            r["ours_us"] = _time(g.replay, calls, reps)
            for key, two in (("one_shot_us", False), ("two_shot_us", True)):
                p = P.plan(numel, esize, world, comm.layout, two_shot=two)
                if p.two_shot != two:
                    continue
                g = _graph(lambda: launch(x, y, comm.peers, rank, comm.layout, two_shot=two), calls)  # noqa: B023
                r[key] = _time(g.replay, calls, reps)
            t = x.clone()
            r["nccl_us"] = _time(lambda: [dist.all_reduce(t) for _ in range(calls)], calls, reps)  # noqa: B023
            try:
                g = _graph(lambda: dist.all_reduce(t), calls)  # noqa: B023
                r["nccl_graph_us"] = _time(g.replay, calls, reps)
            except Exception as exc:  # torch without graph-safe NCCL here: eager only
                r["nccl_graph_detail"] = f"{type(exc).__name__}"
        out.append(r)
    return out


def rank_main(rank: int, world: int, port: int, sizes: Sequence[int], dtype_name: str, calls: int, reps: int,
              timing: bool, q: Any) -> None:
    """One GPU's process: NCCL + gloo groups, the communicator (probe included), every size."""
    try:
        import torch
        import torch.distributed as dist

        from v4flash_kernels.allreduce.comm import IpcAllReduce

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        gloo = dist.new_group(backend="gloo")
        comm = IpcAllReduce(gloo, torch.device("cuda", rank), device_group=dist.group.WORLD)
        res: Dict[str, Any] = {"rank": rank, "active": not comm.disabled, "reason": comm.reason,
                               "probe": comm.probe_result, "sizes": []}
        if not comm.disabled:
            res["sizes"] = _rank_sizes(comm, rank, world, sizes, getattr(torch, dtype_name), calls, reps, timing)
        dist.barrier(group=gloo)
        comm.close()
        dist.destroy_process_group()
        q.put(res)
    except Exception:
        q.put({"rank": rank, "error": traceback.format_exc()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world: int, sizes: Sequence[int] = SIZES, dtype: str = "bfloat16", calls: int = CALLS,
              reps: int = REPS, timing: bool = True, timeout: float = 600.0) -> WorldResult:
    """Spawn `world` processes on GPUs 0..world-1 and merge their results (slowest rank's times)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, list(sizes), dtype, calls, reps, timing, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(q.get(timeout=timeout))
    except Exception as exc:
        return WorldResult(world, error=f"ranks did not report within {timeout:.0f} s: {type(exc).__name__}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return merge_ranks(world, results)


def merge_ranks(world: int, results: Sequence[Dict[str, Any]]) -> WorldResult:
    """Every rank's report -> one row per size: correct only if every rank was right and all agree bit
    for bit; a time only if every rank timed it, and then the slowest rank's."""
    errors = [r for r in results if "error" in r]
    if errors:
        return WorldResult(world, error=f"rank {errors[0]['rank']}: {errors[0]['error']}")
    results = sorted(results, key=lambda r: r["rank"])
    head = results[0]
    wr = WorldResult(world, active=head["active"], reason=head["reason"], probe=head["probe"])
    for i, s0 in enumerate(head["sizes"]):
        per = [r["sizes"][i] for r in results]
        sr = SizeResult(s0["nbytes"], plan=s0.get("plan", ""), detail=s0.get("detail", ""))
        if "ok" in s0:
            same = len({p["digest"] for p in per}) == 1
            sr.correct = all(p["ok"] for p in per) and same
            if not same:
                sr.detail = (sr.detail + "; " if sr.detail else "") + "ranks disagree"
            elif not sr.correct:
                sr.detail = next(p.get("detail", "") for p in per if not p["ok"])
        for key in ("ours_us", "one_shot_us", "two_shot_us", "nccl_us", "nccl_graph_us"):
            vals = [p[key] for p in per if p.get(key) is not None]
            if len(vals) == len(per):
                setattr(sr, key, max(vals))
        wr.sizes.append(sr)
    return wr


# ----------------------------------------------------------------------------- one GPU, simulated


def simulate(worlds: Sequence[int] = (2, 4, 8), sizes: Sequence[int] = SIZES, calls: int = CALLS,
             reps: int = REPS) -> List[WorldResult]:
    """N ranks on one GPU: exactness in and out of a graph, and the protocol's time (no link)."""
    import torch

    from v4flash_kernels.allreduce import plan as P
    from v4flash_kernels.allreduce.reference import rank_order_sum
    from v4flash_kernels.allreduce.simulate import LocalRanks

    out = []
    for world in worlds:
        lr = LocalRanks(world)
        wr = WorldResult(world, active=True, reason="simulated: N ranks on one GPU, N streams")
        for nbytes in sizes:
            numel = max(1, nbytes // 2)
            xs = [torch.rand(numel, device="cuda").to(torch.bfloat16) for _ in range(world)]
            want = rank_order_sum(xs, torch.bfloat16)
            outs = lr.all_reduce(xs)
            ok = all(torch.equal(o, want) for o in outs)
            gouts = [torch.empty_like(x) for x in xs]
            g = _graph(lambda: lr.all_reduce(xs, gouts), 1)  # noqa: B023
            for o in gouts:
                o.zero_()
            g.replay()
            torch.cuda.synchronize()
            ok = ok and all(torch.equal(o, want) for o in gouts)
            g = _graph(lambda: lr.all_reduce(xs, gouts), calls)  # noqa: B023
            sr = SizeResult(numel * 2, plan=P.plan(numel, 2, world).name, correct=ok,
                            ours_us=_time(g.replay, calls, reps))
            wr.sizes.append(sr)
        out.append(wr)
    return out


# ----------------------------------------------------------------------------- entry points


def link_label(world: int) -> str:
    """'<GPU name> x N, NVLink (NV18)' / '..., PCIe (PIX)': what connects GPUs 0..N-1 (nvidia-smi topo -m)."""
    import torch

    name = torch.cuda.get_device_name(0)
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return f"{name} x {world}, link unknown"
    kinds = set()
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0].startswith("GPU") and cells[0][3:].isdigit() and int(cells[0][3:]) < world:
            kinds |= {c for c in cells[1:1 + world] if c != "X"}
    nv = sorted(k for k in kinds if k.startswith("NV"))
    if nv:
        return f"{name} x {world}, NVLink ({', '.join(nv)})"
    return f"{name} x {world}, PCIe ({', '.join(sorted(kinds)) or '?'})"


def measure(world: int, sizes: Sequence[int], dtype: str = "bfloat16") -> Dict[str, Any]:
    """For other benches (the step bench's all-reduce row), on GPUs 0..world-1 of this machine:
    {"link": "<GPU> x N, NVLink (NV18)" | "..., PCIe (PIX)", "active": bool (False: fell back, see
    "reason"), "correct": bool (every size bit-exact on every rank), "us": {nbytes: (ours, nccl)}} with
    µs per all-reduce (ours replayed from a CUDA graph; NCCL in a graph where torch captures it, else eager)."""
    wr = run_world(world, sizes, dtype)
    return {"link": link_label(world), "active": wr.active and not wr.error, "reason": wr.error or wr.reason,
            "correct": bool(wr.sizes) and all(s.correct for s in wr.sizes),
            "us": {s.nbytes: (s.ours_us, s.nccl_graph_us or s.nccl_us) for s in wr.sizes}}


def _fmt(v: float | None) -> str:
    return f"{v:8.2f}" if v is not None else "       -"


def format_table(results: Sequence[WorldResult]) -> str:
    lines = [f"{'ranks':>5} {'bytes':>9} {'plan':<20} {'ok':>3} {'ours':>8} {'1-shot':>8} {'2-shot':>8} "
             f"{'nccl':>8} {'nccl-g':>8} {'vs nccl':>7}   (us per all-reduce)"]
    for wr in results:
        if wr.error or not wr.active:
            lines.append(f"{wr.world:>5}  {'ERROR: ' + wr.error if wr.error else 'fell back to NCCL: ' + wr.reason}")
            continue
        for s in wr.sizes:
            best = min([v for v in (s.nccl_us, s.nccl_graph_us) if v is not None], default=None)
            ratio = f"{best / s.ours_us:6.2f}x" if best and s.ours_us else "      -"
            ok = "-" if s.correct is None else ("yes" if s.correct else "NO")
            lines.append(f"{wr.world:>5} {s.nbytes:>9} {s.plan:<20} {ok:>3} {_fmt(s.ours_us)} {_fmt(s.one_shot_us)} "
                         f"{_fmt(s.two_shot_us)} {_fmt(s.nccl_us)} {_fmt(s.nccl_graph_us)} {ratio}"
                         + (f"  {s.detail}" if s.detail else ""))
    return "\n".join(lines)


def _ints(text: str) -> List[int]:
    return [int(float(t)) for t in text.split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_bench.allreduce", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worlds", default="", help="rank counts (default: 2..the GPUs here)")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="message bytes")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--calls", type=int, default=CALLS, help="all-reduces per timed graph replay")
    ap.add_argument("--reps", type=int, default=REPS, help="timed replays (median)")
    ap.add_argument("--simulate", action="store_true", help="one GPU: N ranks on N streams (protocol cost only)")
    ap.add_argument("--no-timing", action="store_true", help="correctness only")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here", file=sys.stderr)
        return 2
    n = torch.cuda.device_count()
    sizes = _ints(args.sizes)
    t0 = time.time()
    if args.simulate or n < 2:
        if not args.simulate:
            print("one GPU here: simulating N ranks on it (protocol cost, no link); a multi-GPU machine "
                  "measures the all-reduce itself", file=sys.stderr)
        results = simulate(_ints(args.worlds) or (2, 4, 8), sizes, args.calls, args.reps)
        mode, link = "simulated on one GPU", torch.cuda.get_device_name(0)
    else:
        worlds = _ints(args.worlds) or list(range(2, min(n, 8) + 1))
        results = [run_world(w, sizes, args.dtype, args.calls, args.reps, not args.no_timing) for w in worlds]
        mode, link = "multi-process", link_label(max(w.world for w in results))
    print(f"all-reduce bench ({mode}; {link}; {args.dtype}; {time.time() - t0:.0f} s)")
    print(format_table(results))
    if args.json:
        from v4flash_kernels.provenance import measured_commit

        doc = {"mode": mode, "link": link, "dtype": args.dtype, "gpus": n, "commit": measured_commit(),
               "results": [asdict(w) for w in results]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    bad = [w for w in results if w.error or any(s.correct is False for s in w.sizes)]
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    sys.exit(main())
