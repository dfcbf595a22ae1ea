"""Decode of PAIR_SPLIT-ordered MXFP4 words (`repack.PAIR_SPLIT`) into a bf16 weight tile in k order.

Shared by the two GEMMs that read repacked layers: v2's decode GEMM (`repacked_kernel`, the tile is the
MMA's left operand) and v1's prefill tiles (`kernel.gemm_kernel` with ``NIBBLES=1``, the tile is the
right operand). Both then contract against the activation tile in its own contiguous k order: the
word order is undone on the weights, where it costs ~4 instructions per bf16 pair (one mask, one
multiply, one mask, plus the scale's ``mul.rn.bf16x2``), never on the activation, whose k order is
what the shared-memory and MMA-fragment loads are built for.

Every word holds the 8 weights k0..k0+7 of its row; nibble j is k0 + 2j (j < 4) or k0 + 2(j - 4) + 1
(j >= 4), so the bf16 pair (k, k + 1) of one MMA fragment register sits in two nibbles 16 bits apart.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _join_slot(f: int) -> int:
    """Which of the 8 values `_join8` puts at offset f of its word (nested tl.join: bit reversal)."""
    return int(f"{f:03b}"[::-1], 2)


# r_i (pair i = k 2i, 2i + 1 of a word) -> the join slots of its low and high half; the asm below and
# the interpreter branch of `decode_words` both follow this table (a CPU test pins it).
PAIR_SLOTS = tuple((_join_slot(2 * i), _join_slot(2 * i + 1)) for i in range(4))
WORD_ASM = "{ .reg .b32 t; " + " ".join(
    f"mul.rn.bf16x2 t, ${8 + i}, $12; mov.b32 {{${lo}, ${hi}}}, t;" for i, (lo, hi) in enumerate(PAIR_SLOTS)) + " }"
_WORD_ASM = tl.constexpr(WORD_ASM)


@triton.jit
def _pair_bits(w, SHIFT: tl.constexpr, ODD: tl.constexpr):
    """bf16 bits of (nibble j, nibble j + 4) * 2^-126 of PAIR_SPLIT words, j = SHIFT // 4 + ODD.

    The masked nibbles sit 16 bits apart, so one multiply moves both halves' exponent/mantissa
    bits (to 8..6) and sign bits (to 15) at once; the mask drops what lands elsewhere.
    """
    if ODD:  # nibbles at bits 4-7 / 20-23: << 2 and << 8
        return (((w >> SHIFT) & 0x00F000F0) * 0x104) & -2118090304  # 0x81C081C0
    else:  # nibbles at bits 0-3 / 16-19: << 6 and << 12
        return (((w >> SHIFT) & 0x000F000F) * 0x1040) & -2118090304


@triton.jit
def _halves(r, mult):
    """Interpreter: the two bf16 values of a pair word times the fp32 multiplier (numpy keeps subnormals)."""
    return (r << 16).to(tl.float32, bitcast=True) * mult, (r & -65536).to(tl.float32, bitcast=True) * mult


@triton.jit
def decode_words(wd, sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEQ_ASM: tl.constexpr,
                  DOT_DTYPE: tl.constexpr):
    """PAIR_SPLIT words [BLOCK_N, BLOCK_K/8] + e8m0 bytes [BLOCK_N, BLOCK_K/32] -> W [BLOCK_N, BLOCK_K] * 2^-63."""
    G: tl.constexpr = BLOCK_K // 32
    r0 = _pair_bits(wd, 0, False)  # k 0, 1 of the word
    r1 = _pair_bits(wd, 0, True)  # k 2, 3
    r2 = _pair_bits(wd, 8, False)  # k 4, 5
    r3 = _pair_bits(wd, 8, True)  # k 6, 7
    mexp = sc.to(tl.int32) + 63  # bf16/fp32 exponent field of 2^(byte - 64)
    if DEQ_ASM:
        mword = (mexp << 7) | (mexp << 23)
        mword = tl.reshape(tl.broadcast_to(mword[:, :, None], [BLOCK_N, G, 4]), [BLOCK_N, BLOCK_K // 8])
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            asm=_WORD_ASM, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", args=[r0, r1, r2, r3, mword],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:  # same slots as PAIR_SLOTS: pair i's (low, high) half -> (o0, o4), (o2, o6), (o1, o5), (o3, o7)
        mult = (mexp << 23).to(tl.float32, bitcast=True)
        mult = tl.reshape(tl.broadcast_to(mult[:, :, None], [BLOCK_N, G, 4]), [BLOCK_N, BLOCK_K // 8])
        o0, o4 = _halves(r0, mult)
        o2, o6 = _halves(r1, mult)
        o1, o5 = _halves(r2, mult)
        o3, o7 = _halves(r3, mult)
    o0, o1, o2, o3 = o0.to(DOT_DTYPE), o1.to(DOT_DTYPE), o2.to(DOT_DTYPE), o3.to(DOT_DTYPE)
    o4, o5, o6, o7 = o4.to(DOT_DTYPE), o5.to(DOT_DTYPE), o6.to(DOT_DTYPE), o7.to(DOT_DTYPE)
    w8 = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
    return tl.reshape(w8, [BLOCK_N, BLOCK_K])


@triton.jit
def decode_word_groups(wd, sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEQ_ASM: tl.constexpr,
                       DOT_DTYPE: tl.constexpr):
    """PAIR_SPLIT words [BLOCK_N, BLOCK_K/32, 4] + e8m0 bytes [BLOCK_N, BLOCK_K/32] -> W [BLOCK_N, BLOCK_K] * 2^-63.

    `decode_words` with the words grouped by scale: the scale reaches its 4 words by a plain
    broadcast over the last axis, so it is loaded straight into the words' layout (a slice of it).
    Flattening it instead (as `decode_words` does) made Triton move the scales through shared
    memory on every k-step of v1's prefill tiles: a byte store, a load and two barriers.
    """
    G: tl.constexpr = BLOCK_K // 32
    r0 = _pair_bits(wd, 0, False)  # k 0, 1 of the word
    r1 = _pair_bits(wd, 0, True)  # k 2, 3
    r2 = _pair_bits(wd, 8, False)  # k 4, 5
    r3 = _pair_bits(wd, 8, True)  # k 6, 7
    mexp = sc.to(tl.int32) + 63  # bf16/fp32 exponent field of 2^(byte - 64)
    if DEQ_ASM:
        mword = tl.broadcast_to(((mexp << 7) | (mexp << 23))[:, :, None], [BLOCK_N, G, 4])
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            asm=_WORD_ASM, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", args=[r0, r1, r2, r3, mword],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:  # same slots as PAIR_SLOTS
        mult = tl.broadcast_to((mexp << 23).to(tl.float32, bitcast=True)[:, :, None], [BLOCK_N, G, 4])
        o0, o4 = _halves(r0, mult)
        o2, o6 = _halves(r1, mult)
        o1, o5 = _halves(r2, mult)
        o3, o7 = _halves(r3, mult)
    o0, o1, o2, o3 = o0.to(DOT_DTYPE), o1.to(DOT_DTYPE), o2.to(DOT_DTYPE), o3.to(DOT_DTYPE)
    o4, o5, o6, o7 = o4.to(DOT_DTYPE), o5.to(DOT_DTYPE), o6.to(DOT_DTYPE), o7.to(DOT_DTYPE)
    w8 = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
    return tl.reshape(w8, [BLOCK_N, BLOCK_K])
