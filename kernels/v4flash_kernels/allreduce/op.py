"""The SGLang drop-in: `GroupCoordinator._all_reduce_in_place` (sglang 0.5.13.post1, parallel_state.py).

Why this seam: `GroupCoordinator.all_reduce` tries SGLang's custom all-reduce (and quick / mscclpp /
symmetric-memory ones) first and sends everything they refuse to `inplace_all_reduce`, whose only
work is `group._all_reduce_in_place(tensor)`: PyNccl inside CUDA graphs, torch.distributed (NCCL)
eagerly. With more than two PCIe GPUs SGLang's custom all-reduce disables itself, so at TP4 every
decode all-reduce lands here. The contract is upstream's exactly: reduce `input_` (sum) in place
over the group, return None; the one method, looked up on the class at call time.

What is ours: an input the communicator computes exactly (`IpcAllReduce.should`: CUDA, this
group's device, bf16/fp32, contiguous, 1 B .. 8 MiB) in a group `policy.group_eligible`
admits, once the group's communicator set up and its probe passed. Everything else, and every
call of a group whose set-up fell back, runs upstream's method unchanged.

The communicator is set up at the group's first eligible call outside graph capture (all ranks
of a group make the same all-reduce calls in the same order, so they set up together; SGLang's
warm-up runs before its graph capture), and the outcome is logged once per process and group.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, cast

import torch

from v4flash_kernels.allreduce import policy
from v4flash_kernels.hook.patches import ALLREDUCE

PARALLEL_STATE = ALLREDUCE.target_module
_STATE_ATTR = "_v4flash_allreduce"  # on each GroupCoordinator: its IpcAllReduce, or None (not ours)
_UNDECIDED = object()

log = logging.getLogger("v4flash_kernels.allreduce")


def _ensure_handler() -> None:
    """One stderr line per decision in the hook's format, visible before SGLang configures logging."""
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[v4flash-kernels] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def upstream_in_place() -> Callable[[Any, torch.Tensor], None]:
    """Upstream's `GroupCoordinator._all_reduce_in_place`, as the hook kept it (or the class's own)."""
    from v4flash_kernels.hook.hook import upstream_keep_attr

    mod = sys.modules.get(PARALLEL_STATE)
    fn = getattr(mod, upstream_keep_attr(ALLREDUCE), None) if mod is not None else None
    if fn is None and mod is not None:
        fn = getattr(getattr(mod, "GroupCoordinator", None), "_all_reduce_in_place", None)
    if fn is None or fn is group_all_reduce_in_place:
        raise NotImplementedError(f"{ALLREDUCE.upstream_function} is not loaded in this process")
    return cast(Callable[[Any, torch.Tensor], None], fn)


def _upstream_custom_active(group: Any) -> bool:
    ca = getattr(group, "ca_comm", None)
    if ca is None:
        return False
    # the piecewise-graph runner flips `disabled` for a while; `original_disabled` is the set-up's verdict
    return not getattr(ca, "original_disabled", getattr(ca, "disabled", True))


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # a torch without CUDA cannot be capturing
        return False


def _make_communicator(group: Any) -> Any:
    from v4flash_kernels.allreduce.comm import IpcAllReduce

    return IpcAllReduce(group.cpu_group, group.device, device_group=getattr(group, "device_group", None))


# Where the communicator comes from; the CPU tests put a stand-in here.
make_communicator: Callable[[Any], Any] = _make_communicator


def _announce(group: Any, text: str, warn: bool) -> None:
    _ensure_handler()
    name = getattr(group, "unique_name", "?")
    (log.warning if warn else log.info)(
        "all-reduce of group %s (rank %s of %s): %s", name, getattr(group, "rank_in_group", "?"),
        getattr(group, "world_size", "?"), text)


def communicator(group: Any) -> Any | None:
    """The group's active IpcAllReduce, or None (not ours / fell back / not decided yet)."""
    comm = group.__dict__.get(_STATE_ATTR, _UNDECIDED)
    if comm is not _UNDECIDED:
        return comm if comm is not None and not comm.disabled else None
    v = policy.group_eligible(int(getattr(group, "world_size", 1)), bool(getattr(group, "use_custom_allreduce", False)),
                              _upstream_custom_active(group), getattr(getattr(group, "device", None), "type", "?"))
    if not v.ok:
        setattr(group, _STATE_ATTR, None)
        return None
    if _capturing():
        return None  # set up at the next eager call; every rank sees the same capture state
    try:
        comm = make_communicator(group)
    except Exception as exc:  # set-up is collective; an exception here is this rank's bug, reported
        setattr(group, _STATE_ATTR, None)
        _announce(group, f"IPC all-reduce set-up failed ({type(exc).__name__}: {exc}); NCCL is used", True)
        return None
    setattr(group, _STATE_ATTR, comm)
    if comm.disabled:
        _announce(group, f"IPC all-reduce falls back to NCCL: {comm.reason}", True)
        return None
    _announce(group, f"IPC one-/two-shot all-reduce ACTIVE for bf16/fp32 messages up to "
                     f"{comm.layout.max_bytes >> 20} MiB ({comm.probe_result or comm.reason})", False)
    return comm


def group_all_reduce_in_place(self: Any, input_: torch.Tensor) -> None:
    """Drop-in for `GroupCoordinator._all_reduce_in_place(self, input_)`: sum over the group, in place."""
    comm = communicator(self)
    if comm is not None and comm.should(input_):
        comm.all_reduce(input_, input_)
        return None
    return upstream_in_place()(self, input_)
