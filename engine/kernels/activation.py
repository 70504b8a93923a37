"""Fused SiLU-and-mul: reads the merged gate_up projection once and writes silu(gate) * up."""

from __future__ import annotations

import torch
import triton.language as tl

from kvpilot.engine.kernels.numerics import cast_to
from kvpilot.engine.kernels.runtime import can_use_triton, next_power_of_2, triton_kernel
from kvpilot.engine.model import layers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton_kernel
def _silu_and_mul_kernel(
    gate_up_ptr,  # [R, 2 * I]
    out_ptr,  # [R, I]
    stride_in,
    stride_out,
    n_cols,  # I
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the input dtype before the product, as the unfused F.silu(gate) * up does.
    act = cast_to(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRET).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, cast_to(act * up, dtype, INTERPRET), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as kvpilot.engine.model.layers.silu_and_mul: [..., 2 * I] -> [..., I]."""
    if (
        not can_use_triton(gate_up)
        or gate_up.dtype not in SUPPORTED_DTYPES
        or gate_up.dim() < 1
        or gate_up.shape[-1] % 2
    ):
        return layers.silu_and_mul(gate_up)
    n_cols = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*gate_up.shape[:-1], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    num_rows = x2.shape[0]
    if num_rows == 0 or n_cols == 0:
        return out
    out2 = out.view(-1, n_cols)
    block_n = min(1024, next_power_of_2(n_cols))
    kernel = _silu_and_mul_kernel.on(gate_up.device)
    kernel[(num_rows, -(-n_cols // block_n))](
        x2,
        out2,
        x2.stride(0),
        out2.stride(0),
        n_cols,
        BLOCK_N=block_n,
        INTERPRET=gate_up.device.type == "cpu",
        num_warps=4,
    )
    return out
