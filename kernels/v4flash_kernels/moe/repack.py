"""Load-time repack of one MoE layer's routed MXFP4 experts for the decode kernel v2 (`repacked_op`).

The repacked layout (also in docs/kernels.md, "Repacked layout"):

* **Weights: `PAIR_SPLIT` nibble order**, same tensors and shapes as the loader's (`w13 [E, 2I, K/2]`,
  `w2 [E, K, I/2]`, rows unchanged: w13 rows `[0, I)` gate, `[I, 2I)` up), rewritten in place:
  every little-endian 32-bit word of a row holds the 8 weights k0..k0+7 it held before, now the
  even ones (k0, k0+2, k0+4, k0+6) in nibbles 0-3 (bits 0-15) and the odd ones (k0+1, ..., k0+7)
  in nibbles 4-7 (bits 16-31). The loader's order has k0..k0+7 in nibbles 0..7. Why: the bf16 pair
  (k, k+1) that one MMA fragment register holds then sits in two nibbles exactly 16 bits apart, so
  the v2 kernel builds the register from the loaded word with one mask, one multiply and one mask
  (`repacked_kernel._pair_bits`) instead of extracting a byte first: ~25 % fewer instructions in its
  inner loop and 68 instead of 96 registers (sm_120, counted in the generated code).
* **Scales: e8m0 bytes, `float8_e8m0fnu` `[E, rows, K/32]`** (a quarter of the fp32 scales the
  loader leaves: 51 instead of 203 MB read per B=1 step at TP4), each one checked to be an exact
  power of two in `[2^-62, 2^64]` (bytes `kernel.FAST_MIN_BYTE..FAST_MAX_BYTE`), the range the
  kernels' exponent-only decode (`kernel.SCALE_FAST`) is exact for.

A layer whose scales fail the check is not repacked (weights and fp32 scales stay as loaded) and
keeps SGLang's path; `ScaleError` says which scales and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import torch

from v4flash_kernels.moe.kernel import FAST_MAX_BYTE, FAST_MIN_BYTE

LAYOUT = "mxfp4-pairsplit-e8m0u8"  # name of the layout above, recorded in the status
PAIR_SPLIT = (0, 2, 4, 6, 1, 3, 5, 7)  # PAIR_SPLIT nibble j of a word holds the loader's nibble PAIR_SPLIT[j]
CHUNK_EXPERTS = 16  # experts converted per step: bounds the temporaries of the conversion
REPORT_MAX = 3  # offending scales named in an error


def pair_split(words: torch.Tensor) -> torch.Tensor:
    """int32 words in the loader's nibble order -> a new tensor in PAIR_SPLIT order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for j, src in enumerate(PAIR_SPLIT):
        out |= ((w >> (4 * src)) & 0xF) << (4 * j)
    return out.to(torch.int32)  # the low 32 bits


def loader_order(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `pair_split` (tests, and anything that must read a repacked layer's bytes)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for j, src in enumerate(PAIR_SPLIT):
        out |= ((w >> (4 * j)) & 0xF) << (4 * src)
    return out.to(torch.int32)


def repack_weights_(w: torch.Tensor) -> torch.Tensor:
    """Rewrite packed weights [E, rows, K/2] (1-byte dtype, contiguous) in PAIR_SPLIT order, in place,
    CHUNK_EXPERTS experts at a time (no second copy of the experts). Returns `w`."""
    words = _words(w)
    for lo in range(0, words.shape[0], CHUNK_EXPERTS):
        words[lo:lo + CHUNK_EXPERTS] = pair_split(words[lo:lo + CHUNK_EXPERTS])
    return w


def _words(w: torch.Tensor) -> torch.Tensor:
    if w.element_size() != 1 or not w.is_contiguous() or w.shape[-1] % 4:
        raise ValueError(f"packed MXFP4 weights must be a contiguous 1-byte tensor with rows of whole 32-bit "
                         f"words, got {w.dtype} {tuple(w.shape)} stride {w.stride()}")
    return w.view(torch.uint8).view(torch.int32)


class ScaleError(ValueError):
    """Scales the fast decode cannot represent exactly (not a power of two, or out of range)."""


@dataclass(frozen=True)
class RepackedExperts:
    """One layer's experts as the v2 kernels read them; build it with `repack_experts`.

    `w13`/`w2` are uint8 views of PAIR_SPLIT-ordered weights (a repacked layer's own storage);
    `s13`/`s2` are the checked e8m0 bytes as uint8 views (of the layer's `float8_e8m0fnu` scales).
    """

    w13: torch.Tensor  # uint8 [E, 2I, K/2], PAIR_SPLIT nibble order
    w2: torch.Tensor  # uint8 [E, K, I/2], PAIR_SPLIT nibble order
    s13: torch.Tensor  # uint8 [E, 2I, K/32], every byte in [FAST_MIN_BYTE, FAST_MAX_BYTE]
    s2: torch.Tensor  # uint8 [E, K, I/32]

    def __post_init__(self) -> None:
        E, two_i, half_k = self.w13.shape
        inter, hidden = two_i // 2, 2 * half_k
        want = {"w13": (E, 2 * inter, hidden // 2), "w2": (E, hidden, inter // 2),
                "s13": (E, 2 * inter, hidden // 32), "s2": (E, hidden, inter // 32)}
        for name, shape in want.items():
            t = getattr(self, name)
            if t.dtype != torch.uint8 or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"RepackedExperts.{name}: {t.dtype} {tuple(t.shape)} stride {t.stride()}, "
                                 f"want contiguous uint8 {shape}")
        if hidden % 32 or inter % 32:
            raise ValueError(f"MXFP4 needs hidden and intermediate sizes divisible by 32 (got {hidden}, {inter})")

    @property
    def experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w13.shape[2]) * 2

    @property
    def inter(self) -> int:
        return int(self.w13.shape[1]) // 2


def _bytes_of(scale: torch.Tensor) -> torch.Tensor:
    """The e8m0 byte of each scale as uint8 (fp32: its exponent field; e8m0: the byte itself)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _bad_mask(scale: torch.Tensor) -> torch.Tensor:
    """True where a scale is not an exact power of two inside the fast decode's range."""
    b = _bytes_of(scale)
    bad = (b < FAST_MIN_BYTE) | (b > FAST_MAX_BYTE)
    if scale.dtype == torch.float32:
        bits = scale.view(torch.int32)
        bad |= (bits & 0x807FFFFF) != 0  # sign set or mantissa bits: not a positive power of two
    return bad


def check_scales(scale: torch.Tensor, name: str = "scale") -> str | None:
    """None when every scale is exactly representable for the fast decode, else why not.

    Reads the whole tensor on its device and syncs once: a load-time check, not for the forward.
    """
    if scale.dtype not in (torch.float32, torch.float8_e8m0fnu):
        return f"{name}: dtype {scale.dtype} (only float32 values or float8_e8m0fnu bytes are repacked)"
    flat = scale.reshape(-1)
    n_bad = 0
    first: List[Any] = []
    for lo in range(0, flat.numel(), 1 << 24):  # bounded temporaries for any size
        part = flat[lo:lo + (1 << 24)]
        bad = _bad_mask(part)
        k = int(bad.sum())
        if k and not first:
            first = (lo + torch.nonzero(bad)[:REPORT_MAX, 0]).tolist()
        n_bad += k
    if n_bad == 0:
        return None
    examples = ", ".join(f"{_index_of(idx, tuple(scale.shape))}={float(flat[idx].float())!r}" for idx in first)
    return (f"{name}: {n_bad} of {flat.numel()} scales are not exact powers of two in "
            f"[2^{FAST_MIN_BYTE - 127}, 2^{FAST_MAX_BYTE - 127}] (e.g. {examples})")


def _index_of(flat_index: int, shape: Tuple[Any, ...]) -> List[Any]:
    idx = []
    for n in reversed(shape):
        idx.append(flat_index % n)
        flat_index //= n
    return idx[::-1]


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """A new uint8 tensor of the scales' e8m0 bytes, converted CHUNK_EXPERTS experts at a time.

    Only meaningful for scales `check_scales` accepted (their exponent field is the whole value).
    """
    out = torch.empty(scale.shape, dtype=torch.uint8, device=scale.device)
    for lo in range(0, scale.shape[0], CHUNK_EXPERTS):
        out[lo:lo + CHUNK_EXPERTS] = _bytes_of(scale[lo:lo + CHUNK_EXPERTS])
    return out


def repack_experts(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                   *, in_place: bool = False, names: Tuple[Any, ...] = ("w13_scale", "w2_scale")) -> RepackedExperts:
    """The v2 form of one layer's experts from the loader's tensors (int8/uint8 nibbles, fp32 or
    float8_e8m0fnu scales): PAIR_SPLIT weights and new uint8 e8m0 scale bytes.

    `in_place=True` rewrites `w13`/`w2` themselves (a loaded layer: no second copy of the experts;
    they then hold PAIR_SPLIT order, which only v2 and v1 with `nibbles=1` read); the default leaves
    them alone and repacks copies (benchmarks and tests that keep the loader's tensors too).
    Raises ScaleError naming the offending scales (as `names` calls them) when any is not an exact
    power of two in the fast decode's range (such a layer must stay on a path that multiplies its
    scales in); the weights are not touched then.
    """
    for name, s in zip(names, (w13_scale, w2_scale)):
        why = check_scales(s, name)
        if why is not None:
            raise ScaleError(why)
    if not in_place:
        w13, w2 = w13.contiguous().clone(), w2.contiguous().clone()
    ws = [repack_weights_(w).view(torch.uint8) for w in (w13, w2)]
    return RepackedExperts(ws[0], ws[1], e8m0_bytes(w13_scale), e8m0_bytes(w2_scale))
