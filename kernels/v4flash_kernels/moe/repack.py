"""Load-time repack of one MoE layer's routed MXFP4 experts for the decode kernel v2 (`op_v2`).

The repacked layout (also in docs/kernels.md, "Repacked layout"):

* **Weights: the loader's bytes, untouched.** `w13 [E, 2I, K/2]` and `w2 [E, K, I/2]`, row-major,
  two e2m1 values per byte, k even in the low nibble; w13 rows `[0, I)` gate, `[I, 2I)` up. This
  is already the order the v2 kernel wants in its registers: one byte is one bf16 pair (k, k+1),
  i.e. one 32-bit MMA fragment register after the decode, and a tile's bytes are contiguous along
  k (16-byte `cp.async` into the software pipeline, then byte loads in the dot-operand layout).
  Any permutation would only cost a second copy at load time.
* **Scales: e8m0 bytes, `float8_e8m0fnu` `[E, rows, K/32]`** (a quarter of the fp32 scales the
  loader leaves: 51 instead of 203 MB read per B=1 step at TP4), each one checked to be an exact
  power of two in `[2^-62, 2^64]` (bytes `kernel.FAST_MIN_BYTE..FAST_MAX_BYTE`), the range the
  kernels' exponent-only decode (`kernel.SCALE_FAST`) is exact for. Stored as `float8_e8m0fnu`
  so that any consumer that does not know about the repack (upstream's function converts them with
  `.to(float32)`, our drop-in decodes e8m0 bytes exactly) still computes the right values.

A layer whose scales fail the check is not repacked: its fp32 scales stay and SGLang keeps calling
the function it called before (`ScaleError` says which scales and why; the caller logs it once and
records it for `status`/`doctor`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_kernels.moe.kernel import FAST_MAX_BYTE, FAST_MIN_BYTE

LAYOUT = "mxfp4-rowmajor-e8m0u8"  # name of the layout above, recorded in the status
CHUNK_EXPERTS = 16  # experts converted per step: bounds the temporaries of the conversion
REPORT_MAX = 3  # offending scales named in an error


class ScaleError(ValueError):
    """Scales the fast decode cannot represent exactly (not a power of two, or out of range)."""


@dataclass(frozen=True)
class RepackedExperts:
    """One layer's experts as the v2 kernels read them; build it with `repack_experts`.

    `w13`/`w2` are uint8 views of the layer's own weight storage; `s13`/`s2` are the checked e8m0
    bytes as uint8 views (of a `float8_e8m0fnu` tensor the layer may also hold).
    """

    w13: torch.Tensor  # uint8 [E, 2I, K/2]
    w2: torch.Tensor  # uint8 [E, K, I/2]
    s13: torch.Tensor  # uint8 [E, 2I, K/32], every byte in [FAST_MIN_BYTE, FAST_MAX_BYTE]
    s2: torch.Tensor  # uint8 [E, K, I/32]

    def __post_init__(self) -> None:
        E, two_i, half_k = self.w13.shape
        inter, hidden = two_i // 2, 2 * half_k
        want = {"w13": (E, 2 * inter, hidden // 2), "w2": (E, hidden, inter // 2),
                "s13": (E, 2 * inter, hidden // 32), "s2": (E, hidden, inter // 32)}
        for name, shape in want.items():
            t = getattr(self, name)
            if t.dtype != torch.uint8 or tuple(t.shape) != shape or t.stride(-1) != 1:
                raise ValueError(f"RepackedExperts.{name}: {t.dtype} {tuple(t.shape)} stride {t.stride()}, "
                                 f"want uint8 {shape} with a contiguous last dim")
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
    first = None
    for lo in range(0, flat.numel(), 1 << 24):  # bounded temporaries for any size
        part = flat[lo:lo + (1 << 24)]
        bad = _bad_mask(part)
        k = int(bad.sum())
        if k and first is None:
            first = lo + torch.nonzero(bad)[:REPORT_MAX, 0]
        n_bad += k
    if n_bad == 0:
        return None
    examples = ", ".join(f"{_index_of(idx, tuple(scale.shape))}={float(flat[idx].float())!r}" for idx in first.tolist())
    return (f"{name}: {n_bad} of {flat.numel()} scales are not exact powers of two in "
            f"[2^{FAST_MIN_BYTE - 127}, 2^{FAST_MAX_BYTE - 127}] (e.g. {examples})")


def _index_of(flat_index: int, shape: tuple) -> list:
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


def _as_u8(w: torch.Tensor) -> torch.Tensor:
    if w.element_size() != 1:
        raise ValueError(f"packed MXFP4 weights must be a 1-byte dtype, got {w.dtype}")
    u = w.view(torch.uint8)
    return u if u.stride(-1) == 1 else u.contiguous()


def repack_experts(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                   w2_scale: torch.Tensor) -> RepackedExperts:
    """The v2 view of one layer's experts from the loader's tensors (int8/uint8 nibbles, fp32 or
    float8_e8m0fnu scales). The weights are viewed, not copied; the scales become new uint8 bytes.

    Raises ScaleError naming the offending scales when any is not an exact power of two in the
    fast decode's range (such a layer must stay on a path that multiplies its scales in).
    """
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        why = check_scales(s, name)
        if why is not None:
            raise ScaleError(why)
    return RepackedExperts(_as_u8(w13), _as_u8(w2), e8m0_bytes(w13_scale), e8m0_bytes(w2_scale))
