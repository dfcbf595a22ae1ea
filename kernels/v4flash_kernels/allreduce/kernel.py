"""Triton kernels of the IPC all-reduce: one-shot and two-shot, push-based, flags at system scope.

Push, not pull: on PCIe a write to a peer is a posted transaction while a read waits a round trip,
so each rank writes its data into its peers' buffers and then reads only its own memory. The peers'
buffers arrive as int64 addresses (P0..P7, mapped into this process through CUDA IPC) and are cast to
pointers in the kernel; the cast hides their alignment, so `tl.multiple_of` restores it (slots,
halves and tiles all start on 16-byte boundaries) and the pushes vectorise. Layout, epochs and the
two-halves argument: `plan.py`.

Memory ordering: a CTA's data stores are ordered before its flag by a CTA barrier followed by a
release exchange at system scope (`atom.release.sys`); a waiter polls with volatile loads, then one
acquire compare-and-swap at system scope and a barrier let the whole CTA read; received data is read
with `.cg` (L2, which owns this GPU's memory) so no stale L1 line can be used. The epoch bookkeeping
is local to the GPU (`.gpu` scope). check_sm120 checks all of it in the PTX.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _peer(P0, P1, P2, P3, P4, P5, P6, P7, p: tl.constexpr):
    if p == 0:
        return P0
    elif p == 1:
        return P1
    elif p == 2:
        return P2
    elif p == 3:
        return P3
    elif p == 4:
        return P4
    elif p == 5:
        return P5
    elif p == 6:
        return P6
    else:
        return P7


@triton.jit
def _begin(P0, P1, P2, P3, P4, P5, P6, P7, rank, WORLD: tl.constexpr):
    """(own buffer address, this call's epoch) read from the own buffer's state."""
    own = P0
    for p in tl.static_range(1, WORLD):
        if rank == p:
            own = _peer(P0, P1, P2, P3, P4, P5, P6, P7, p)
    state = own.to(tl.pointer_type(tl.int64))
    epoch = tl.load(state, volatile=True) + 1
    return own, epoch


@triton.jit
def _signal(P0, P1, P2, P3, P4, P5, P6, P7, rank, epoch, FLAGS_OFF: tl.constexpr, WORLD: tl.constexpr,
            MAX_CTAS: tl.constexpr):
    """Every thread's stores so far, then `flags[rank][pid] = epoch` in every peer (release, system scope)."""
    tl.debug_barrier()
    slot = FLAGS_OFF + (rank * MAX_CTAS + tl.program_id(0)) * 8
    for p in tl.static_range(WORLD):
        if p != rank:
            flag = (_peer(P0, P1, P2, P3, P4, P5, P6, P7, p) + slot).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")


@triton.jit
def _wait(own, rank, epoch, FLAGS_OFF: tl.constexpr, WORLD: tl.constexpr, MAX_CTAS: tl.constexpr,
          SPIN_LIMIT: tl.constexpr):
    """Until every peer raised this CTA's flag for `epoch` (or later) in the own buffer.

    Every thread polls with plain volatile loads (no barrier per iteration); once the flag is seen,
    one acquire RMW at system scope orders the CTA's later reads after the peer's release, and the barrier
    after it hands that to every thread. SPIN_LIMIT 0 waits for ever, like NCCL; the start-up probe
    bounds it (one budget for all peers) and marks a time-out in the state's third word, so a box
    whose peer writes never arrive (ACS) falls back within seconds instead of hanging.
    """
    spins = 0
    for s in tl.static_range(WORLD):
        if s != rank:
            flag = (own + FLAGS_OFF + (s * MAX_CTAS + tl.program_id(0)) * 8).to(tl.pointer_type(tl.int64))
            seen = tl.load(flag, volatile=True)
            if SPIN_LIMIT > 0:
                while (seen < epoch) & (spins < SPIN_LIMIT):
                    seen = tl.load(flag, volatile=True)
                    spins += 1
            else:
                while seen < epoch:
                    seen = tl.load(flag, volatile=True)
            # a compare-and-swap that never swaps (flags are >= 0): an RMW the compiler cannot drop, unlike
            # an acquire load whose value is unused
            never = tl.full([], -1, tl.int64)
            seen = tl.atomic_cas(flag, never, never, sem="acquire", scope="sys")
            if SPIN_LIMIT > 0:
                if seen < epoch:
                    tl.atomic_xchg(own.to(tl.pointer_type(tl.int64)) + 2, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _finish(own, epoch):
    """The last CTA to arrive stores the epoch: the next call (or graph replay) reads epoch + 1."""
    tl.debug_barrier()
    state = own.to(tl.pointer_type(tl.int64))
    arrived = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(state + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state, epoch, sem="release", scope="gpu")


# `rank` is not specialised (rank 1 would compile a binary of its own); `n` is (16-divisible sizes vectorise).
@triton.jit(do_not_specialize=["rank"])
def one_shot_kernel(X, OUT, P0, P1, P2, P3, P4, P5, P6, P7, rank, n, slot, span,
                    WORLD: tl.constexpr, BLOCK: tl.constexpr, DATA_OFF: tl.constexpr, HALF_BYTES: tl.constexpr,
                    FLAGS1_OFF: tl.constexpr, MAX_CTAS: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """OUT[i] = sum over ranks 0..WORLD-1 of X_r[i]; slot = elements between rank slots, span = per CTA."""
    elt = X.dtype.element_ty
    esize: tl.constexpr = elt.primitive_bitwidth // 8
    own, epoch = _begin(P0, P1, P2, P3, P4, P5, P6, P7, rank, WORLD)
    half = DATA_OFF + (epoch % 2) * HALF_BYTES
    mine = half + rank.to(tl.int64) * slot * esize
    start = tl.program_id(0).to(tl.int64) * span
    end = tl.minimum(start + span, n)
    offs = tl.arange(0, BLOCK)
    for base in range(start, end, BLOCK):
        idx = base + offs
        mask = idx < end
        x = tl.load(X + idx, mask=mask)
        for p in tl.static_range(WORLD):
            if p != rank:
                dst = (_peer(P0, P1, P2, P3, P4, P5, P6, P7, p) + mine).to(tl.pointer_type(elt))
                tl.store(tl.multiple_of(dst + idx, 16), x, mask=mask)
    _signal(P0, P1, P2, P3, P4, P5, P6, P7, rank, epoch, FLAGS1_OFF, WORLD, MAX_CTAS)
    _wait(own, rank, epoch, FLAGS1_OFF, WORLD, MAX_CTAS, SPIN_LIMIT)
    recv = (own + half).to(tl.pointer_type(elt))
    for base in range(start, end, BLOCK):
        idx = base + offs
        mask = idx < end
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(WORLD):
            if s == rank:
                v = tl.load(X + idx, mask=mask)
            else:
                v = tl.load(tl.multiple_of(recv + s * slot + idx, 16), mask=mask, cache_modifier=".cg")
            acc += v.to(tl.float32)
        tl.store(OUT + idx, acc.to(OUT.dtype.element_ty), mask=mask)
    _finish(own, epoch)


@triton.jit(do_not_specialize=["rank"])
def two_shot_kernel(X, OUT, P0, P1, P2, P3, P4, P5, P6, P7, rank, n, slot, span,
                    WORLD: tl.constexpr, BLOCK: tl.constexpr, DATA_OFF: tl.constexpr, HALF_BYTES: tl.constexpr,
                    FLAGS1_OFF: tl.constexpr, FLAGS2_OFF: tl.constexpr, MAX_CTAS: tl.constexpr,
                    SPIN_LIMIT: tl.constexpr):
    """Reduce-scatter then all-gather; chunk c (slot elements) is reduced by rank c, in rank order."""
    elt = X.dtype.element_ty
    esize: tl.constexpr = elt.primitive_bitwidth // 8
    own, epoch = _begin(P0, P1, P2, P3, P4, P5, P6, P7, rank, WORLD)
    half = DATA_OFF + (epoch % 2) * HALF_BYTES
    scatter_mine = half + rank.to(tl.int64) * slot * esize  # my slot in each owner's scatter area
    gather_mine = scatter_mine + WORLD * slot * esize  # my slot in each peer's gather area
    start = tl.program_id(0).to(tl.int64) * span
    end = tl.minimum(start + span, slot)
    offs = tl.arange(0, BLOCK)
    # 1. scatter: sub-block [start, end) of every other rank's chunk goes to that rank
    for base in range(start, end, BLOCK):
        local = base + offs
        for c in tl.static_range(WORLD):
            if c != rank:
                gidx = c * slot + local
                mask = (local < end) & (gidx < n)
                x = tl.load(X + gidx, mask=mask)
                dst = (_peer(P0, P1, P2, P3, P4, P5, P6, P7, c) + scatter_mine).to(tl.pointer_type(elt))
                tl.store(tl.multiple_of(dst + local, 16), x, mask=mask)
    _signal(P0, P1, P2, P3, P4, P5, P6, P7, rank, epoch, FLAGS1_OFF, WORLD, MAX_CTAS)
    _wait(own, rank, epoch, FLAGS1_OFF, WORLD, MAX_CTAS, SPIN_LIMIT)
    # 2. reduce the own chunk in rank order, keep it and push it to every peer's gather area
    scatter = (own + half).to(tl.pointer_type(elt))
    for base in range(start, end, BLOCK):
        local = base + offs
        gidx = rank * slot + local
        mask = (local < end) & (gidx < n)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(WORLD):
            if s == rank:
                v = tl.load(X + gidx, mask=mask)
            else:
                v = tl.load(tl.multiple_of(scatter + s * slot + local, 16), mask=mask, cache_modifier=".cg")
            acc += v.to(tl.float32)
        val = acc.to(OUT.dtype.element_ty)
        tl.store(OUT + gidx, val, mask=mask)
        for p in tl.static_range(WORLD):
            if p != rank:
                dst = (_peer(P0, P1, P2, P3, P4, P5, P6, P7, p) + gather_mine).to(tl.pointer_type(elt))
                tl.store(tl.multiple_of(dst + local, 16), val, mask=mask)
    _signal(P0, P1, P2, P3, P4, P5, P6, P7, rank, epoch, FLAGS2_OFF, WORLD, MAX_CTAS)
    _wait(own, rank, epoch, FLAGS2_OFF, WORLD, MAX_CTAS, SPIN_LIMIT)
    # 3. the other ranks' reduced chunks, from the own gather area
    gather = (own + half + WORLD * slot * esize).to(tl.pointer_type(elt))
    for base in range(start, end, BLOCK):
        local = base + offs
        for c in tl.static_range(WORLD):
            if c != rank:
                gidx = c * slot + local
                mask = (local < end) & (gidx < n)
                v = tl.load(tl.multiple_of(gather + c * slot + local, 16), mask=mask, cache_modifier=".cg")
                tl.store(OUT + gidx, v, mask=mask)
    _finish(own, epoch)
