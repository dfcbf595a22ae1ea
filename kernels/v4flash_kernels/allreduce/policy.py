"""When the IPC all-reduce takes a group's all-reduces and when it leaves them to NCCL: pure decisions.

Every decision that involves more than one rank is taken from facts gathered from *all* ranks, so
every rank of a group takes the same one: a rank that used our kernel while a peer used NCCL would
wait for flags that never come.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from v4flash_kernels.allreduce.plan import WORLDS, world_ok

# A peer path this much slower than NCCL at the probe size is not worth taking (it is then usually
# P2P staged through host memory, or ACS sending every write up to the root complex).
SLOW_VS_NCCL = 1.0
# Without an NCCL timing: slower than this (µs, one 64 KB all-reduce) is slow on any box.
SLOW_ABSOLUTE_US = 100.0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


def group_eligible(world_size: int, use_custom_allreduce: bool, upstream_custom_active: bool,
                   device_type: str) -> Verdict:
    """Whether a SGLang GroupCoordinator's in-place (NCCL) all-reduces are ours to take at all.

    Ours only where upstream itself would have used a custom all-reduce but could not: groups
    SGLang builds with its custom all-reduce allowed (the TP groups; `--disable-custom-all-reduce`
    and deterministic inference turn that off, and we follow), whose own custom all-reduce is
    absent or disabled (more than two PCIe GPUs). Where upstream's is active it stays in charge.
    """
    if device_type != "cuda":
        return Verdict(False, f"the group runs on {device_type}, not CUDA")
    if not world_ok(world_size):
        return Verdict(False, f"world size {world_size} is not one of {WORLDS}")
    if not use_custom_allreduce:
        return Verdict(False, "SGLang's custom all-reduce is disabled for this group "
                              "(--disable-custom-all-reduce, deterministic inference or a non-TP group)")
    if upstream_custom_active:
        return Verdict(False, "SGLang's own custom all-reduce is active for this group (NVLink or 2 GPUs)")
    return Verdict(True, "eligible")


def agree(local: Sequence[Tuple[bool, str]]) -> Verdict:
    """All ranks' (ok, why-not) for one setup step -> one verdict, the first failing rank named."""
    for rank, (ok, why) in enumerate(local):
        if not ok:
            return Verdict(False, f"rank {rank}: {why}")
    return Verdict(True, "all ranks ready")


def peers_mappable(uuids: Sequence[str], can_access: Sequence[Sequence[bool | None]], *,
                   shared_gpu: bool = False) -> Verdict:
    """Rank-by-rank peer access (None: that pair is not visible from that rank; the IPC open decides).
    `shared_gpu` admits ranks on one GPU (the one-GPU tests of the process path)."""
    if len(set(uuids)) != len(uuids) and not shared_gpu:
        return Verdict(False, "two ranks share one GPU")
    for a, row in enumerate(can_access):
        for b, ok in enumerate(row):
            if a != b and ok is False:
                return Verdict(False, f"GPU of rank {a} cannot access the GPU of rank {b} (no P2P: "
                                      "`v4flash-pd doctor` checks ACS, IOMMU and the PCIe topology)")
    return Verdict(True, "peer access possible")


def probe_verdict(correct: Sequence[bool], ours_us: Sequence[float], nccl_us: Sequence[float] | None,
                  nbytes: int) -> Verdict:
    """The start-up probe's result from every rank: exact results, and not slower than NCCL."""
    bad = [r for r, ok in enumerate(correct) if not ok]
    if bad:
        return Verdict(False, f"probe all-reduce was wrong or timed out on rank(s) {bad} "
                              "(peer writes not arriving: ACS/IOMMU? see `v4flash-pd doctor`)")
    ours = max(ours_us)
    if nccl_us:
        nccl = max(nccl_us)
        if ours > SLOW_VS_NCCL * nccl:
            return Verdict(False, f"peer access is slow: {ours:.1f} us per {nbytes // 1024} KB all-reduce vs "
                                  f"NCCL's {nccl:.1f} us (P2P through host memory? see `v4flash-pd doctor`)")
        return Verdict(True, f"{ours:.1f} us per {nbytes // 1024} KB all-reduce vs NCCL's {nccl:.1f} us")
    if ours > SLOW_ABSOLUTE_US:
        return Verdict(False, f"peer access is slow: {ours:.1f} us per {nbytes // 1024} KB all-reduce "
                              f"(> {SLOW_ABSOLUTE_US:.0f} us)")
    return Verdict(True, f"{ours:.1f} us per {nbytes // 1024} KB all-reduce (no NCCL timing)")
