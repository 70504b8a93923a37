"""The KV write: each new token's key and value into its slot of the paged cache."""

from __future__ import annotations

import torch
import triton.language as tl

from kvpilot.engine.kernels.numerics import cast_to
from kvpilot.engine.kernels.runtime import next_power_of_2, triton_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton_kernel
def _write_kv_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs
    tl.store(
        k_dst + offs_h[:, None] * stride_kch + offs_d[None, :],
        cast_to(k, k_cache_ptr.dtype.element_ty, INTERPRET),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :],
        cast_to(v, v_cache_ptr.dtype.element_ty, INTERPRET),
        mask=mask,
    )


def is_supported(key: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        key.dtype in SUPPORTED_DTYPES
        and k_cache.dtype in SUPPORTED_DTYPES
        and key.stride(-1) == 1
        and k_cache.stride(-1) == 1
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key[t], value[t] at slot_mapping[t] = block * block_size + offset. The slots are not
    checked (that would read them back on the host): each must lie in the cache.

    key/value: [T, KVH, D]; k_cache/v_cache: [num_blocks, block_size, KVH, D], written in place.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [tokens, kv_heads, head_dim], got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"caches must be [blocks, block_size, {key.shape[1]}, {key.shape[2]}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(slot_mapping.shape) != (key.shape[0],) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"slot_mapping must be int32/int64 of shape ({key.shape[0]},), got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if key.dtype != value.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"key/value and the two caches must agree in dtype, got {key.dtype}/{value.dtype} and "
            f"{k_cache.dtype}/{v_cache.dtype}"
        )
    if not (is_supported(key, k_cache) and is_supported(value, v_cache)):
        raise ValueError(
            f"write_kv supports {SUPPORTED_DTYPES} contiguous in head_dim, got {key.dtype} -> "
            f"{k_cache.dtype}, strides {key.stride()} -> {k_cache.stride()}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    kernel = _write_kv_kernel.on(key.device)
    kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        INTERPRET=key.device.type == "cpu",
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
