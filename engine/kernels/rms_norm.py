"""Fused residual add + RMSNorm: one read of x and the residual, one write of each output."""

from __future__ import annotations

import torch
import triton.language as tl

from kvpilot.engine.kernels.numerics import cast_to
from kvpilot.engine.kernels.runtime import can_use_triton, next_power_of_2, triton_kernel
from kvpilot.engine.model import layers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 65536


@triton_kernel
def _rms_norm_kernel(
    x_ptr,  # [R, N]
    residual_ptr,  # [R, N], only when HAS_RESIDUAL
    weight_ptr,  # [N]
    out_ptr,  # [R, N]
    residual_out_ptr,  # [R, N], only when HAS_RESIDUAL
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the input dtype first, as the unfused `x + residual` does.
        summed = cast_to(x + r, dtype, INTERPRET)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = cast_to(x * inv_rms, dtype, INTERPRET).to(
        tl.float32
    )  # the reference rounds before the weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols,
        cast_to(w * normed, out_ptr.dtype.element_ty, INTERPRET),
        mask=mask,
    )


def is_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    return (
        x.dim() >= 1
        and x.dtype in SUPPORTED_DTYPES
        and weight.dtype in SUPPORTED_DTYPES
        and weight.shape == x.shape[-1:]
        and 0 < x.shape[-1] <= MAX_HIDDEN
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kvpilot.engine.model.layers.rms_norm: (normed, new_residual)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not (can_use_triton(*tensors) and is_supported(x, weight, residual)):
        return layers.rms_norm(x, weight, eps, residual)
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        r2, residual_out = x2, x  # without a residual, x itself is the next residual
    else:
        r2 = residual.reshape(-1, n_cols)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ro2 = residual_out.view(-1, n_cols) if residual is not None else x2
    out2 = out.view(-1, n_cols)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out, residual_out
    block_n = next_power_of_2(n_cols)
    kernel = _rms_norm_kernel.on(x.device)
    kernel[(num_rows,)](
        x2,
        r2,
        weight,
        out2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        ro2.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        INTERPRET=x.device.type == "cpu",
        num_warps=min(16, max(1, block_n // 512)),
    )
    return out, residual_out
