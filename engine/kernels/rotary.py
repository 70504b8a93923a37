"""Fused neox-style rotary embedding of query and key in one launch, one program per token."""

from __future__ import annotations

import torch
import triton.language as tl

from kvpilot.engine.kernels.numerics import cast_to
from kvpilot.engine.kernels.runtime import can_use_triton, next_power_of_2, triton_kernel
from kvpilot.engine.model import layers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton_kernel
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, KVH, D]
    q_out_ptr,  # [T, H, D] contiguous
    k_out_ptr,  # [T, KVH, D] contiguous
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, D] fp32: cos of the half-dims, then sin
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    d_ok = offs < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cache + offs, mask=d_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + offs, mask=d_ok, other=0.0)[None, :]

    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < NUM_HEADS) & d_ok[None, :]
    src = q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = q_out_ptr + (token * NUM_HEADS + heads[:, None]) * (2 * HALF) + offs[None, :]
    tl.store(dst, cast_to(x1 * cos - x2 * sin, dtype, INTERPRET), mask=mask)
    tl.store(dst + HALF, cast_to(x2 * cos + x1 * sin, dtype, INTERPRET), mask=mask)

    kv_heads = tl.arange(0, BLOCK_KH)
    kv_mask = (kv_heads[:, None] < NUM_KV_HEADS) & d_ok[None, :]
    src = k_ptr + token * stride_kt + kv_heads[:, None] * stride_kh + offs[None, :]
    y1 = tl.load(src, mask=kv_mask, other=0.0).to(tl.float32)
    y2 = tl.load(src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    dst = k_out_ptr + (token * NUM_KV_HEADS + kv_heads[:, None]) * (2 * HALF) + offs[None, :]
    tl.store(dst, cast_to(y1 * cos - y2 * sin, dtype, INTERPRET), mask=kv_mask)
    tl.store(dst + HALF, cast_to(y2 * cos + y1 * sin, dtype, INTERPRET), mask=kv_mask)


def is_supported(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> bool:
    return (
        query.dim() == 3
        and key.dim() == 3
        and query.shape[0] == key.shape[0] == positions.shape[0]
        and query.shape[-1] == key.shape[-1] == cos_sin_cache.shape[-1]
        and query.shape[-1] % 2 == 0
        and query.dtype == key.dtype
        and query.dtype in SUPPORTED_DTYPES
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.dim() == 2
        and positions.dim() == 1
        and not positions.is_floating_point()
        and query.stride(-1) == 1
        and key.stride(-1) == 1
        and cos_sin_cache.stride(-1) == 1
    )


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kvpilot.engine.model.layers.apply_rotary: new (query, key), inputs kept.

    query: [T, H, D] and key: [T, KVH, D] may be strided views (e.g. slices of a fused qkv output).
    """
    if not (
        can_use_triton(query, key, positions, cos_sin_cache)
        and is_supported(query, key, positions, cos_sin_cache)
    ):
        return layers.apply_rotary(query, key, positions, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    kernel = _rotary_kernel.on(query.device)
    kernel[(num_tokens,)](
        query,
        key,
        q_out,
        k_out,
        positions,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_KH=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(half),
        INTERPRET=query.device.type == "cpu",
        num_warps=4,
    )
    return q_out, k_out
