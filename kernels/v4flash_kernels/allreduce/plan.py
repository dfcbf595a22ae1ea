"""The all-reduce's arithmetic, pure: buffer layout, one-shot vs two-shot, grid, epochs and flags.

Every rank computes the same plan from the same (bytes, dtype size, world size), so the kernels of
one call agree on where each rank's data lands in every peer's buffer without talking. Nothing
here depends on run-time state: a CUDA graph captured once replays correctly.

Protocol (per call, `e` = the call's epoch, read from the rank's own buffer and advanced by the
last CTA to finish, so replays of a captured graph need no host-side reset):
* one-shot: CTA j pushes its span of the input into slot `rank` of every peer's data half `e % 2`,
  then raises `flags1[rank][j] = e` in every peer; it waits until `flags1[s][j] >= e` for every
  peer s in its own buffer and sums the N contributions in rank order 0..N-1 (fp32).
* two-shot: chunk c of the message belongs to rank c. CTA j pushes its sub-block of every chunk to
  the chunk's owner (scatter slot `rank`), raises flags1, waits, reduces its own chunk in rank
  order, pushes the result into every peer's gather slot `rank`, raises flags2, waits and copies
  the gathered chunks out.
Both orders are fixed, so every rank gets the same bits, and one-shot and two-shot agree too.

Why two halves suffice: a rank enters call e+1 only after all its CTAs saw every peer's flags of
call e, i.e. after every peer started call e and therefore finished call e-1; so a peer's call
e+1 writes (half (e+1) % 2) never land in a half anyone still reads.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_RANKS = 8
MAX_CTAS = 32  # flag slots per sender; also the largest grid (every CTA of all ranks co-resident)
ALIGN_BYTES = 128  # slot / chunk alignment in a half (16-byte vectors, whole cache lines)
BLOCK_BYTES = 4096  # bytes one CTA moves per loop step (one 16-byte vector per thread)
NUM_WARPS = 8
ONE_SHOT_CTA_BYTES = 16 * 1024  # message bytes per CTA (one-shot pushes them to N-1 peers)
TWO_SHOT_CTA_BYTES = 32 * 1024  # chunk bytes per CTA (two-shot)
DEFAULT_MAX_BYTES = 8 * 1024 * 1024  # SGLang's custom all-reduce stops at 8 MiB too
ELEMENT_SIZES = (2, 4)  # bf16, fp32

# One-shot up to this many bytes per world size, two-shot above. One-shot moves (N-1) x S per rank
# in one flag round; two-shot 2 (N-1)/N x S in two rounds: with a flag round of L and a per-GPU
# link bandwidth B they cross near S = L B / ((N-1)(1-2/N)), i.e. one-shot always wins at 2 ranks
# and the crossover falls with N. Values for PCIe (L ~ 3 us, B ~ 25 GB/s); the bench prints both
# algorithms per size so they can be set from a measurement on the box.
ONE_SHOT_MAX = {2: DEFAULT_MAX_BYTES, 3: 128 * 1024, 4: 64 * 1024, 5: 32 * 1024, 6: 32 * 1024,
                7: 16 * 1024, 8: 16 * 1024}

STATE_OFF = 0  # int64 words: epoch (last finished call), CTAs arrived in the running call, error
STATE_ERROR = 2  # word set to 1 when a bounded wait (the probe's) timed out
FLAGS1_OFF = 256  # int64 [MAX_RANKS][MAX_CTAS], written by the peers
FLAGS2_OFF = FLAGS1_OFF + MAX_RANKS * MAX_CTAS * 8
DATA_OFF = 8192


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


@dataclass(frozen=True)
class Layout:
    """One rank's registered buffer (the same on every rank): state, two flag arrays, two data halves."""

    max_bytes: int = DEFAULT_MAX_BYTES

    @property
    def half_bytes(self) -> int:
        # two-shot needs scatter + gather slots: 2 x N x round_up(S / N) <= 2 S + 2 N (ALIGN + element)
        return round_up(2 * self.max_bytes + 2 * MAX_RANKS * (ALIGN_BYTES + max(ELEMENT_SIZES)), 4096)

    @property
    def total_bytes(self) -> int:
        return DATA_OFF + 2 * self.half_bytes

    def half_off(self, epoch: int) -> int:
        return DATA_OFF + (epoch % 2) * self.half_bytes

    @staticmethod
    def flag_off(which: int, sender: int, cta: int) -> int:
        """Byte offset, in the receiver's buffer, of the flag `sender` raises for CTA `cta`."""
        return (FLAGS1_OFF if which == 1 else FLAGS2_OFF) + (sender * MAX_CTAS + cta) * 8


@dataclass(frozen=True)
class Plan:
    """One call: which algorithm, how many CTAs, the element granularity of slots and chunks."""

    two_shot: bool
    ctas: int
    block: int  # elements per CTA loop step
    align: int  # elements per ALIGN_BYTES
    numel: int
    world: int

    @property
    def name(self) -> str:
        return f"{'two' if self.two_shot else 'one'}-shot/n{self.world}/c{self.ctas}"

    @property
    def slot(self) -> int:
        """Elements between consecutive ranks' slots in a half (one-shot: the message; two-shot: a chunk)."""
        return round_up(cdiv(self.numel, self.world) if self.two_shot else self.numel, self.align)

    @property
    def span(self) -> int:
        """Elements of the message (one-shot) or of each chunk (two-shot) one CTA handles."""
        return round_up(cdiv(self.slot, self.ctas), self.block)

    def footprint(self) -> int:
        """Bytes of a data half this call uses."""
        esize = BLOCK_BYTES // self.block
        return (2 if self.two_shot else 1) * self.world * self.slot * esize


# Rank counts ours takes (others fall back to NCCL): 2..8 but 7, whose two-shot start-up probe binary
# ptxas spills on sm_90 (12 bytes); no DeepSeek-V4 TP size is 7 (its 64 heads split by powers of two).
WORLDS = (2, 3, 4, 5, 6, 8)


def world_ok(world: int) -> bool:
    return world in WORLDS


def fits(nbytes: int, element_size: int, layout: Layout) -> bool:
    """Whether a message is ours at all (else the caller's fallback runs): size, granularity."""
    return 0 < nbytes <= layout.max_bytes and element_size in ELEMENT_SIZES and nbytes % element_size == 0


def plan(numel: int, element_size: int, world: int, layout: Layout = Layout(),
         two_shot: bool | None = None, ctas: int | None = None) -> Plan:
    """The launch for one all-reduce of `numel` elements; `two_shot` / `ctas` force the algorithm / grid
    (tests and the bench only; a forced one-shot that does not fit a half becomes two-shot)."""
    nbytes = numel * element_size
    if not world_ok(world):
        raise ValueError(f"all-reduce over {world} ranks: supported are {WORLDS}")
    if not fits(nbytes, element_size, layout):
        raise ValueError(f"all-reduce of {nbytes} B ({element_size}-byte elements) is outside "
                         f"1..{layout.max_bytes} B or not 2/4-byte elements")
    if two_shot is None:
        two_shot = nbytes > ONE_SHOT_MAX[world]
    block = BLOCK_BYTES // element_size
    align = ALIGN_BYTES // element_size
    work = cdiv(nbytes, world) if two_shot else nbytes
    if ctas is None:
        ctas = max(1, min(MAX_CTAS, cdiv(work, TWO_SHOT_CTA_BYTES if two_shot else ONE_SHOT_CTA_BYTES)))
    elif not 1 <= ctas <= MAX_CTAS:
        raise ValueError(f"ctas={ctas}: 1..{MAX_CTAS}")
    p = Plan(two_shot, ctas, block, align, numel, world)
    if p.footprint() > layout.half_bytes:
        if two_shot:  # cannot happen: half_bytes is sized for two-shot of max_bytes
            raise AssertionError(f"{p.name}: {p.footprint()} B do not fit a {layout.half_bytes} B half")
        return plan(numel, element_size, world, layout, True, ctas)  # N one-shot slots too big: two-shot
    return p


# ----------------------------------------------------------------------------- epochs and flags


def next_epoch(stored: int) -> int:
    """The epoch of the call that starts when the buffer's state holds `stored` (0 on a fresh buffer)."""
    return stored + 1


def flag_ready(flag: int, epoch: int) -> bool:
    """A peer's flag releases call `epoch` once it reached it; it may already be one call ahead.

    Flags are int64 and only grow (2^63 calls never wrap), so no modular comparison is needed, and
    a fresh (zeroed) buffer never satisfies the first call, whose epoch is 1.
    """
    return flag >= epoch
