"""Self-check cases of the IPC all-reduce (`allreduce`): the whole TP group, one process per GPU.

Unlike the other patches this one cannot be checked on a GPU alone: its correctness is the peer
writes between the group's processes. So every GPU of a worker runs these cases at once, as its
TP rank, and the ranks meet through a file store the launcher names (`Target.group`): each
process sets up the communicator exactly as the SGLang drop-in does (its own `cudaMalloc`, CUDA
IPC handles exchanged over a gloo group, the peers' buffers opened, the start-up probe), then
calls the drop-in `GroupCoordinator._all_reduce_in_place` replacement on the message sizes the
worker sends: one decode row of hidden 4096 bf16, the largest captured decode batch, the
speculative verify batches, and prefill chunks up to the largest message ours takes (8 MiB:
SGLang's own limit; a bigger chunk stays with NCCL). The largest decode message is captured in a
CUDA graph and replayed on fresh inputs, as the worker's decode graphs do.

Every rank draws every rank's input from the case seed, so each computes the exact sum itself:
ours must equal the rank-order fp32 sum bit for bit (what every rank returns) and be the exact sum
correctly rounded. "Upstream" is NCCL's all-reduce (what SGLang runs for these groups) on the same
inputs, where the ranks sit on distinct GPUs; NCCL refuses two ranks on one GPU, so the one-GPU
test of the process path (`shared_gpu`) has no upstream row.

Cases are collective: every rank must build and run the same cases in the same order (the runner
does; a rank whose process died leaves its peers' set-up to time out, which fails the case).
"""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Dict, List

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, registry_function

PATCH = "allreduce"
HIDDEN = 4096
SETUP_TIMEOUT_S = 180.0  # every rank compiles and meets within this (a missing rank fails the check)

_group: Dict[str, Any] = {}  # this process's one group: the stand-in coordinator, built once


def message_rows(target: Target) -> List[int]:
    """Rows of hidden-size bf16 messages the worker all-reduces that ours takes (<= 8 MiB)."""
    from v4flash_kernels.allreduce import plan as P

    cap = P.DEFAULT_MAX_BYTES // (HIDDEN * 2)
    rows = {1, *target.batches, *target.verify_rows}
    if target.prefill_rows:
        rows.update({min(target.prefill_rows, cap), min(target.prefill_rows, 512)})
    return sorted(r for r in rows if 1 <= r <= cap)


def cases(target: Target) -> List[Case]:
    if target.tp_size < 2:
        return [Case("TP 1: no all-reduce", SMALL, lambda seed: {}, lambda kw: None, lambda kw: None,
                     _nothing_to_reduce, upstream_skip="a TP-1 worker never all-reduces")]
    if not target.group:
        raise ValueError("the all-reduce check runs across the worker's GPUs: the launcher must name the "
                         "group's rendezvous (--group FILE)")
    if target.small_only:
        return [_case("odd size 4099 bf16 elements", SMALL, 0, target, numel=4099),
                _case(f"1 x {HIDDEN} bf16", SMALL, 1, target)]
    rows = message_rows(target)
    largest_decode = max(r for r in rows if r <= max(target.batches + target.verify_rows))
    out = [_case(f"{n} x {HIDDEN} bf16", PRODUCTION, n, target, graph=n == largest_decode) for n in rows]
    out.insert(0, _case("odd size 4099 bf16 elements", SMALL, 0, target, numel=4099))
    return out


def _nothing_to_reduce(out: Any, ref: Any, kw: Inputs) -> Comparison:
    return Comparison(True, {"world": 1})


def coordinator(target: Target) -> Any:
    """A stand-in for SGLang's `GroupCoordinator` (the attributes the drop-in reads) over a real gloo
    group and, on distinct GPUs, a real NCCL group; the communicator is set up here, collectively."""
    key = f"{target.group}:{target.tp_rank}/{target.tp_size}"
    if key in _group:
        return _group[key]
    import torch
    import torch.distributed as dist

    from v4flash_kernels.allreduce import op
    from v4flash_kernels.allreduce.comm import IpcAllReduce

    device = torch.device("cuda", torch.cuda.current_device()) if target.is_cuda else torch.device("cpu")
    store = dist.FileStore(target.group, target.tp_size)  # type: ignore[attr-defined]  # re-exported from torch._C
    timeout = timedelta(seconds=SETUP_TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=target.tp_rank, world_size=target.tp_size, timeout=timeout)
    cpu_group = dist.group.WORLD
    nccl = None if target.shared_gpu or not target.is_cuda else dist.new_group(backend="nccl", timeout=timeout)
    coord = SimpleNamespace(world_size=target.tp_size, rank_in_group=target.tp_rank, use_custom_allreduce=True,
                            ca_comm=None, device=device, cpu_group=cpu_group, device_group=nccl,
                            unique_name=f"selfcheck-tp:{os.path.basename(target.group)}")
    comm: Any = (IpcAllReduce(cpu_group, device, device_group=nccl, shared_gpu=target.shared_gpu) if target.is_cuda
                 else SharedFileBuffers(target.group, target.tp_rank, target.tp_size, cpu_group))
    if comm.disabled:
        raise RuntimeError(f"the IPC all-reduce did not set up on this group: {comm.reason}")
    setattr(coord, op._STATE_ATTR, comm)
    _group[key] = coord
    return coord


class SharedFileBuffers:
    """The interpreter's stand-in for the CUDA IPC buffers (no GPU): each rank's buffer a file that
    every rank maps shared, so the real kernels' pushes and flags cross process boundaries exactly
    as peer writes do (the interpreter's loads, stores and atomics are the host's). The files are
    new per check (a stale one would hold a finished epoch): an existing file is refused."""

    MAX_BYTES = 64 * 1024

    def __init__(self, group: str, rank: int, world: int, cpu_group: Any) -> None:
        import torch
        import torch.distributed as dist

        from v4flash_kernels.allreduce import plan as P

        self.layout, self.rank, self.disabled, self.reason = P.Layout(self.MAX_BYTES), rank, False, ""
        path = f"{group}.buf{rank}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        os.close(fd)
        size = self.layout.total_bytes
        mine = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        dist.barrier(group=cpu_group)
        self._bufs = [mine if r == rank else torch.from_file(f"{group}.buf{r}", shared=True, size=size,
                                                             dtype=torch.uint8) for r in range(world)]
        self.peers = tuple(b.data_ptr() for b in self._bufs)
        dist.barrier(group=cpu_group)
        os.unlink(path)  # every rank mapped it: the mappings outlive the name

    def should(self, inp: Any) -> bool:
        from v4flash_kernels.allreduce import plan as P
        from v4flash_kernels.allreduce.launch import DTYPES

        return inp.dtype in DTYPES and inp.is_contiguous() and P.fits(inp.numel() * inp.element_size(),
                                                                      inp.element_size(), self.layout)

    def all_reduce(self, inp: Any, out: Any = None) -> Any:
        from v4flash_kernels.allreduce.launch import launch

        out = inp if out is None else out
        launch(inp, out, self.peers, self.rank, self.layout)
        return out


def _case(name: str, size: str, rows: int, target: Target, graph: bool = False, numel: int = 0) -> Case:
    n = numel or rows * HIDDEN
    up = None if target.shared_gpu or not target.is_cuda else _nccl
    return Case(name, size, lambda seed: _inputs(n, seed, target), _ours, _reference, _compare, upstream=up,
                upstream_skip="" if up else ("NCCL refuses two ranks on one GPU (the one-GPU process-path check)"
                                             if target.is_cuda else "NCCL needs GPUs"),
                graph=graph)


def _all_inputs(n: int, seed: int, world: int, device: Any) -> Any:
    """Every rank's input [world, n], drawn from the seed (the same on every rank): on a GPU bf16
    values of several magnitudes and signs, so the sums round. One tensor, so a graph replay's fresh inputs
    are copied into it too."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    if device.type != "cuda":  # Triton's interpreter truncates fp32 -> bf16: small integers sum exactly
        return torch.randint(-64, 65, (world, n), generator=g, device=device).to(torch.bfloat16)
    return (torch.randn((world, n), generator=g, device=device) * 4).to(torch.bfloat16)


def _inputs(n: int, seed: int, target: Target) -> Inputs:
    coord = coordinator(target)
    xs = _all_inputs(n, seed, target.tp_size, coord.device)
    return {"x": xs[target.tp_rank].clone(), "all": xs, "coord": coord}


def _ours(kw: Inputs) -> Any:
    """The drop-in as SGLang calls it: in place on this rank's tensor, returns None."""
    registry_function(PATCH)(kw["coord"], kw["x"])
    return kw["x"]


class NcclSum:
    """NCCL's result, tagged: it adds in its own (ring) order and rounds to bf16 at every hop."""

    def __init__(self, out: Any) -> None:
        self.out = out


def _nccl(kw: Inputs) -> Any:
    import torch.distributed as dist

    y = kw["x"].clone()
    dist.all_reduce(y, group=kw["coord"].device_group)
    return NcclSum(y)


def _reference(kw: Inputs) -> Any:
    from v4flash_kernels.allreduce.reference import all_reduce_ref, rank_order_sum

    xs = list(kw["all"].unbind(0))
    return {"exact": all_reduce_ref(xs), "rank_order": rank_order_sum(xs, xs[0].dtype)}


def _compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    import torch

    from v4flash_kernels.allreduce.reference import max_ulp_error

    if isinstance(out, NcclSum):
        # per hop one bf16 rounding of a partial sum: within world/2 ulps of the exact sum (upstream's
        # row: reported beside ours, never held against it); how far it sits from ours is recorded
        ulps = max_ulp_error(out.out, ref["exact"])
        vs_ours = max_ulp_error(out.out, ref["rank_order"].to(torch.float64))
        ok = ulps <= len(kw["all"]) / 2 + 0.5
        return Comparison(ok, {"max_ulp_vs_exact": round(ulps, 4), "max_ulp_vs_ours": round(vs_ours, 4)},
                          "" if ok else f"NCCL's sum is {ulps:.2f} ulps from the exact sum")

    same = bool(torch.equal(out, ref["rank_order"]))
    ulps = max_ulp_error(out, ref["exact"])
    differ = int((out != ref["rank_order"]).sum().item())
    # one rounding of an fp32 sum of <= 8 terms: correctly rounded up to a double rounding
    ok = same and ulps <= 0.5 + 2.0 ** -8
    metrics = {"max_ulp_vs_exact": round(ulps, 4), "elements_differing_from_rank_order_sum": differ,
               "numel": out.numel()}
    why = "" if ok else (f"{differ} elements differ from the rank-order fp32 sum (every rank must return it)"
                         if not same else f"{ulps:.3f} ulps from the exact sum")
    return Comparison(ok, metrics, why)
