"""Device helpers shared by the kernels.

Triton's CPU interpreter (3.6 to 3.9) converts float32 to bfloat16 by truncation, or with a rounding
that does not carry into the exponent when asked for round-to-nearest-even, while the GPU rounds to
nearest even. Kernels therefore cast through `cast_to`, which, under the interpreter, rounds the
float32 bits itself first so that the interpreter's conversion only drops zero bits. The compiled
path is a plain cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from kvpilot.engine.kernels.runtime import triton_helper


@triton_helper
def cast_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        # Round to nearest even at bit 16: add 0x7FFF plus the lowest kept bit, then clear the rest.
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 cache dtype as the kernels see it: uint8 codes with MANT mantissa bits and exponent
    bias BIAS. fp8_decode yields float16 values that are the code's value divided by f16_factor
    (exactly), so the kernels multiply f16_factor into the scales they already apply."""

    mant: int
    bias: int
    f16_factor: float


FP8_FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(mant=3, bias=7, f16_factor=256.0),  # 2**(15 - 7)
    torch.float8_e5m2: Fp8Format(mant=2, bias=15, f16_factor=1.0),  # float16's top byte
}


# The FP8 formats are coded by integer arithmetic on the bits, on the GPU as in the interpreter:
# Triton's interpreter (3.6 to 3.9) reads some FP8 codes wrongly and rounds some writes differently
# from torch's cast, and the compiled casts to float8e4nv need sm_89 or later. The integer path
# gives the same bytes everywhere; the KV write is a small part of a step and the read adds a few
# integer operations per loaded byte to a loop bound by memory.
@triton_helper
def fp8_decode(code, MANT: tl.constexpr):
    """uint8 FP8 codes -> float16 holding value / f16_factor, exact for every code (subnormals
    included; e4m3fn's 0x7f/0xff are NaN, e5m2's infinities and NaNs are float16's)."""
    bits = code.to(tl.int32)
    if MANT == 2:
        half = bits << 8  # e5m2 is float16 with the low mantissa byte cut off
    else:
        # Sign to bit 15, exponent and mantissa to float16's places: the value over 2**(15 - 7)
        # (a subnormal code lands on a float16 subnormal of the same ratio).
        half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
        half = tl.where((bits & 0x7F) == 0x7F, half | 0x7E00, half)
    return half.to(tl.uint16).to(tl.float16, bitcast=True)


@triton_helper
def fp8_quantize(x, scale, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """kv_quant.quantize in a kernel: fp8(clamp(x / scale, -MAX, MAX)) as uint8 codes, the bytes
    torch's cast gives. (One helper: the interpreter swaps in twins of a kernel module's helpers
    only, so a helper here cannot call another.)"""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    # NaN passes (tl.minimum/maximum may drop it on the GPU); the clamp saturates as torch's does.
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -MAX), MAX))
    # Encode, rounding to nearest even as torch's cast does.
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exponent = mag >> 23  # float32's biased exponent
    SHIFT: tl.constexpr = 23 - MANT
    # A normal FP8 value: rebias the exponent in place, then round the mantissa at bit SHIFT (a
    # carry moves into the exponent, as it should).
    rebiased = mag - ((127 - BIAS) << 23)
    normal = (rebiased + ((1 << (SHIFT - 1)) - 1) + ((rebiased >> SHIFT) & 1)) >> SHIFT
    # A subnormal one: the mantissa with its leading 1, in units of the smallest subnormal.
    mantissa = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(SHIFT + (128 - BIAS) - exponent, 31)
    tiny = (mantissa + (1 << (shift - 1)) - 1 + ((mantissa >> shift) & 1)) >> shift
    tiny = tl.where(exponent == 0, 0, tiny)  # float32 zeros and subnormals
    code = tl.where(exponent >= 128 - BIAS, normal, tiny)
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)
