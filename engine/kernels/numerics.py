"""Device helpers shared by the kernels.

Triton's CPU interpreter (3.6 to 3.9) converts float32 to bfloat16 by truncation, or with a rounding
that does not carry into the exponent when asked for round-to-nearest-even, while the GPU rounds to
nearest even. Kernels therefore cast through `cast_to`, which, under the interpreter, rounds the
float32 bits itself first so that the interpreter's conversion only drops zero bits. The compiled
path is a plain cast.
"""

from __future__ import annotations

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
