"""Fused neox-style rotary embedding of query and key in one launch, one program per token; with
TO_CACHE the rotated key and the value go straight into their slot of the paged KV cache (the
rotary and the KV write in one kernel, the rotated key never written elsewhere)."""

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
    k_out_ptr,  # [T, KVH, D] contiguous; TO_CACHE: the key cache [blocks, BLOCK_SIZE, KVH, D]
    v_ptr,  # TO_CACHE only: [T, KVH, D]
    v_cache_ptr,  # TO_CACHE only: [blocks, BLOCK_SIZE, KVH, D]
    slot_mapping_ptr,  # TO_CACHE only: [T]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, D] fp32: cos of the half-dims, then sin
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # TO_CACHE: block, slot and head strides of both caches
    stride_cs,
    stride_ch,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TO_CACHE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
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
    if TO_CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        at_slot = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        dst = k_out_ptr + at_slot + kv_heads[:, None] * stride_ch + offs[None, :]
        # The cache's dtype is the key's (write_kv's contract), so one rounding, as there.
        v_src = v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh + offs[None, :]
        v_dst = v_cache_ptr + at_slot + kv_heads[:, None] * stride_ch + offs[None, :]
        tl.store(v_dst, tl.load(v_src, mask=kv_mask), mask=kv_mask)
        tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)
    else:
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
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if query.shape[0] == 0:
        return q_out, k_out
    _launch(query, key, q_out, k_out, positions, cos_sin_cache)
    return q_out, k_out


def _launch(
    query: torch.Tensor,
    key: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    value: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """k_out: the rotated keys' tensor, or (with value, v_cache and slot_mapping) the key cache."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    to_cache = v_cache is not None
    cache = v_cache if v_cache is not None else k_out
    v = value if value is not None else key
    kernel = _rotary_kernel.on(query.device)
    kernel[(num_tokens,)](
        query,
        key,
        q_out,
        k_out,
        v,
        cache,
        slot_mapping if slot_mapping is not None else positions,
        positions,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        v.stride(0),
        v.stride(1),
        cache.stride(0) if to_cache else 0,
        cache.stride(1) if to_cache else 0,
        cache.stride(2) if to_cache else 0,
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_KH=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        TO_CACHE=to_cache,
        BLOCK_SIZE=cache.shape[1] if to_cache else 1,
        INTERPRET=query.device.type == "cpu",
        num_warps=4,
    )


def rotary_write_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor | None:
    """apply_rotary, then write_kv of the rotated key and the value, in one kernel: returns the
    rotated query; None where the kernel does not apply (then run the two ops). The caches must
    have the key's dtype and the same layout (the KV write's contract); the slots are not checked.
    """
    if not (
        can_use_triton(query, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
        and is_supported(query, key, positions, cos_sin_cache)
        and value.shape == key.shape
        and value.dtype == key.dtype
        and value.stride(-1) == 1
        and k_cache.dim() == 4
        and k_cache.shape[2:] == key.shape[1:]
        and v_cache.shape == k_cache.shape
        and v_cache.stride() == k_cache.stride()
        and k_cache.dtype == v_cache.dtype == key.dtype
        and k_cache.stride(-1) == 1
        and tuple(slot_mapping.shape) == (key.shape[0],)
        and slot_mapping.dtype in (torch.int32, torch.int64)
    ):
        return None
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0]:
        _launch(query, key, q_out, k_cache, positions, cos_sin_cache, value, v_cache, slot_mapping)
    return q_out
