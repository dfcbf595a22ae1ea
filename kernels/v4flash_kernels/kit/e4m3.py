"""The block-FP8 activation quant as Triton device functions: one 128-wide group of fp32 values ->
e4m3 codes and an fp32 scale, bit for bit `kit.fp8.quantize_activation_ref` (the format's definition).

Shared by every kernel that quantizes an activation on the fly (the FP8 linears, the fused q path,
the fused shared expert), so a fusion's codes are the linear's codes by construction.
"""

import triton
import triton.language as tl

GROUP = tl.constexpr(128)  # quantization group along K (block_size[1]) and the K step of the loop
FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-10)


@triton.jit
def round_e4m3(v):
    """`v` (fp32, |v| <= 448) rounded to nearest-even on the e4m3 grid, as fp32 (sign of zero kept)."""
    bits = v.to(tl.int32, bitcast=True)
    # Normals (|v| >= 2^-6): keep 3 of 23 mantissa bits, ties to even; a carry bumps the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormals (|v| < 2^-6): multiples of 2^-9; adding 1.5 * 2^14 puts the rounding point there.
    sub = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -2147483648)
    return tl.where(tl.abs(v) < 0.015625, sub.to(tl.float32, bitcast=True), normal)


@triton.jit
def quant_groups(x, AXIS: tl.constexpr):
    """One 128-wide group along axis AXIS of fp32 `x` (any rank) -> (e4m3 codes, fp32 scales with AXIS reduced)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=AXIS), AMAX_FLOOR)
    mult = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    v = x * tl.expand_dims(mult, AXIS)
    q = round_e4m3(tl.clamp(v, -FP8_MAX, FP8_MAX)).to(tl.float8e4nv)
    return q, amax * (1.0 / 448.0)
