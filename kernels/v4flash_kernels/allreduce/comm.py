"""One process's end of the IPC all-reduce for one process group: buffers, exchange, probe, calls.

Set-up is collective over a CPU (gloo) group and done once: every rank allocates one buffer
(`plan.Layout`), shares its CUDA IPC handle, opens its peers' handles in its own device context,
and runs a start-up probe (exact results with bounded waits, then the time of a 64 KB all-reduce in
a CUDA graph against NCCL's). Each step ends with every rank's result gathered, so all ranks enable
or all fall back together; `disabled`/`reason` say which and why. After that a call is one kernel
launch on the current stream, graph-capturable (nothing is allocated and the epochs live on the GPU).
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist

from v4flash_kernels.allreduce import plan as P
from v4flash_kernels.allreduce import policy
from v4flash_kernels.allreduce.cudart import CudaRT
from v4flash_kernels.allreduce.launch import DTYPES, launch

PROBE_BYTES = 64 * 1024
PROBE_CALLS = 16  # per timed graph replay
PROBE_SPINS = 1 << 21  # bounded flag waits in the probe (about a second per kernel, not for ever)


def probe_input(numel: int, rank: int, device: Any) -> torch.Tensor:
    """Small integers: every partial sum is exact in bf16, so any rank can compute the exact result."""
    i = torch.arange(numel, device=device, dtype=torch.int64)
    return ((i * 7 + rank * 13) % 31 - 15).to(torch.bfloat16)


def probe_expected(numel: int, world: int, device: Any) -> torch.Tensor:
    zero = torch.zeros(numel, device=device, dtype=torch.float32)
    return sum((probe_input(numel, r, device).float() for r in range(world)), zero).to(torch.bfloat16)


def _step(fn: Callable[[], Any]) -> Tuple[bool, str]:
    try:
        fn()
        return True, ""
    except Exception as exc:  # one rank's failure must reach the agreement, not skip it
        return False, f"{type(exc).__name__}: {exc}"


class IpcAllReduce:
    """All-reduce (sum) over `group`'s ranks through CUDA IPC; `disabled` -> the caller uses NCCL."""

    def __init__(self, group: Any, device: Any, *, device_group: Any = None, layout: P.Layout = P.Layout(),
                 probe: bool = True, shared_gpu: bool = False) -> None:
        """`shared_gpu`: ranks may share one GPU (the one-GPU tests and self-check of the process path:
        CUDA IPC between processes of one device is real, but the contexts time-slice, so the probe
        checks exact results only and gives no timing verdict). Never set by the SGLang drop-in."""
        self.group = group
        self.device = torch.device(device)
        self.layout = layout
        self.rank = dist.get_rank(group=group)
        self.world = dist.get_world_size(group=group)
        self.peers: Tuple[int, ...] = ()
        self.probe_result = ""
        self._rt: CudaRT | None = None
        self._own = 0
        self._opened: List[int] = []
        self.disabled = True
        self.shared_gpu = shared_gpu
        with torch.inference_mode(False):  # gloo's object collectives fail under inference mode
            verdict = self._setup(device_group, probe)
        self.disabled, self.reason = not verdict.ok, verdict.reason
        if self.disabled:
            self.close()

    # ------------------------------------------------------------------------- set-up

    def _gather(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _agree(self, local: Tuple[bool, str]) -> policy.Verdict:
        return policy.agree(self._gather(local))

    def _setup(self, device_group: Any, probe: bool) -> policy.Verdict:
        if not P.world_ok(self.world):
            return policy.Verdict(False, f"world size {self.world} is not one of {P.WORLDS}")
        handle = b""

        def prepare() -> None:
            nonlocal handle
            with torch.cuda.device(self.device):
                self._rt = CudaRT()
                self._own = self._rt.malloc(self.layout.total_bytes)
                self._rt.memset(self._own, 0, self.layout.total_bytes)
                handle = self._rt.ipc_handle(self._own)

        ok = _step(prepare)
        infos = self._gather((ok, socket.gethostname(), self._uuid(self.device), handle))
        v = policy.agree([i[0] for i in infos])
        if not v.ok:
            return v
        hosts = {i[1] for i in infos}
        if len(hosts) > 1:
            return policy.Verdict(False, f"the group spans hosts {sorted(hosts)}")
        uuids = [i[2] for i in infos]
        v = policy.peers_mappable(uuids, self._gather_access(uuids), shared_gpu=self.shared_gpu)
        if not v.ok:
            return v
        v = self._agree(_step(lambda: self._open([i[3] for i in infos])))
        if not v.ok:
            return v
        if not probe:
            return policy.Verdict(True, "set up (no probe)")
        return self._probe(device_group)

    @staticmethod
    def _uuid(device: torch.device) -> str:
        """The GPU's UUID (same in every process, whatever CUDA_VISIBLE_DEVICES numbers it)."""
        try:
            return str(torch.cuda.get_device_properties(device).uuid)
        except Exception:
            return f"{socket.gethostname()}:{os.getpid()}:{device}"  # unknown: never equal to a peer's

    @staticmethod
    def _visible_uuids() -> List[str]:
        try:
            return [IpcAllReduce._uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
        except Exception:
            return []

    def _gather_access(self, uuids: Sequence[str]) -> List[List[bool | None]]:
        """Each rank's `can_device_access_peer` towards every peer it can see (None: not visible, the IPC open decides)."""
        row: List[bool | None] = [None] * len(uuids)
        try:
            visible = self._visible_uuids()
            me = self.device.index if self.device.index is not None else torch.cuda.current_device()
            for r, u in enumerate(uuids):
                if u in visible and visible.index(u) != me:
                    row[r] = bool(torch.cuda.can_device_access_peer(me, visible.index(u)))
        except Exception:
            pass
        return self._gather(row)

    def _open(self, handles: Sequence[bytes]) -> None:
        assert self._rt is not None
        peers = []
        with torch.cuda.device(self.device):
            for r, h in enumerate(handles):
                if r == self.rank:
                    peers.append(self._own)
                else:
                    ptr = self._rt.ipc_open(h)
                    self._opened.append(ptr)
                    peers.append(ptr)
        self.peers = tuple(peers)

    def _error_word(self) -> int:
        assert self._rt is not None
        torch.cuda.synchronize(self.device)
        raw = self._rt.read(self._own + P.STATE_OFF + 8 * P.STATE_ERROR, 8)
        return int(struct.unpack("<q", raw)[0])

    def _probe(self, device_group: Any) -> policy.Verdict:
        """Exact results for one- and two-shot in both buffer halves, then ours vs NCCL at 64 KB.

        Every kernel here waits a bounded time (`PROBE_SPINS`), so a rank that fails or never sees its
        peers' writes costs its peers seconds, not a hang. Ranks compile first and meet at a barrier
        before the first launch: one rank's slower compile must not look like a missing peer.
        """
        n = PROBE_BYTES // 2
        with torch.cuda.device(self.device):
            x = probe_input(n, self.rank, self.device)
            want = probe_expected(n, self.world, self.device)

            def run(out: torch.Tensor, two_shot: bool | None, compile_only: bool = False) -> None:
                launch(x, out, self.peers, self.rank, self.layout, two_shot=two_shot, spin_limit=PROBE_SPINS,
                       compile_only=compile_only)

            def compile_all() -> None:
                for t in (False, True, None):
                    run(torch.empty_like(x), t, True)

            v = self._agree(_step(compile_all))
            if not v.ok:
                return v
            dist.barrier(group=self.group)

            def check() -> None:
                wrong = []
                for two_shot in (False, True, False, True):
                    out = torch.empty_like(x)
                    run(out, two_shot)
                    torch.cuda.synchronize(self.device)
                    if self._error_word() != 0:
                        raise RuntimeError("a peer's flag never arrived (bounded wait timed out)")
                    if not torch.equal(out, want):
                        wrong.append("two-shot" if two_shot else "one-shot")
                if wrong:
                    raise RuntimeError(f"wrong sums: {', '.join(wrong)}")

            correct = self._gather(_step(check))
            if not all(c[0] for c in correct):
                return policy.probe_verdict([c[0] for c in correct], [0.0], None, PROBE_BYTES)
            if self.shared_gpu:
                self.probe_result = "exact results (ranks share one GPU: not timed)"
                return policy.Verdict(True, self.probe_result)

            def timed() -> Tuple[float, float | None]:
                ours = self._time_ours(lambda out: run(out, None), x)
                if self._error_word() != 0:
                    raise RuntimeError("a peer's flag never arrived while timing")
                return ours, (self._time_nccl(x, device_group) if device_group is not None else None)

            try:
                mine: Tuple[Any, ...] = (*timed(), "")
            except Exception as exc:
                mine = (None, None, f"{type(exc).__name__}: {exc}")
            times = self._gather(mine)
        failed = [(r, t[2]) for r, t in enumerate(times) if t[2]]
        if failed:
            return policy.Verdict(False, f"probe timing failed on rank {failed[0][0]}: {failed[0][1]}")
        ncc = [t[1] for t in times]
        v = policy.probe_verdict([True] * self.world, [t[0] for t in times],
                                 None if any(t is None for t in ncc) else ncc, PROBE_BYTES)
        self.probe_result = v.reason
        return v

    def _time_ours(self, call: Callable[[torch.Tensor], None], x: torch.Tensor) -> float:
        """µs per call of `call(out)` replayed from a CUDA graph of PROBE_CALLS calls."""
        out = torch.empty_like(x)
        for _ in range(3):
            call(out)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        # thread_local: the worker's other threads (scheduler, KV transfer) keep using CUDA meanwhile
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(PROBE_CALLS):
                call(out)
        return _time_replays(lambda: g.replay(), PROBE_CALLS, self.device)

    @staticmethod
    def _time_nccl(x: torch.Tensor, device_group: Any) -> float | None:
        t = x.clone()
        try:
            for _ in range(3):
                dist.all_reduce(t, group=device_group)
            return _time_replays(lambda: [dist.all_reduce(t, group=device_group) for _ in range(PROBE_CALLS)],
                                 PROBE_CALLS, x.device)
        except Exception:  # no NCCL group to compare with: the absolute bound decides
            return None

    # ------------------------------------------------------------------------- calls

    def should(self, inp: torch.Tensor) -> bool:
        """Whether `inp` is ours: the exact cases the kernels compute (anything else stays with NCCL)."""
        if self.disabled or not inp.is_cuda or inp.device != self.device or inp.dtype not in DTYPES:
            return False
        nbytes = inp.numel() * inp.element_size()
        return inp.is_contiguous() and P.fits(nbytes, inp.element_size(), self.layout)

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over the group into `out` (a new tensor if None; `inp` itself for in place)."""
        if out is None:
            out = torch.empty_like(inp)
        launch(inp, out, self.peers, self.rank, self.layout)
        return out

    def close(self) -> None:
        """Unmap the peers and free the own buffer (after the GPU finished with them)."""
        rt, self._rt = self._rt, None
        if rt is None:
            return
        try:
            torch.cuda.synchronize(self.device)
        except Exception:
            pass
        for ptr in self._opened:
            try:
                rt.ipc_close(ptr)
            except Exception:
                pass
        self._opened = []
        if self._own:
            try:
                rt.free(self._own)
            except Exception:
                pass
        self._own = 0
        self.peers = ()
        self.disabled = True


def _time_replays(run: Callable[[], Any], calls: int, device: Any, reps: int = 5) -> float:
    """µs per call: the median of `reps` timed runs of `run` (each `calls` calls), after one warm run."""
    run()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / calls)
    return float(sorted(times)[len(times) // 2])
