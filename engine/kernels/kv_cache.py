"""The KV write: each new token's key and value into its slot of the paged cache, in the cache's
dtype or quantized to FP8 with per-head scales (kv_quant.py's format, bit for bit)."""

from __future__ import annotations

import torch
import triton.language as tl

from kvpilot.engine.attention.kv_quant import fp8_max, is_fp8
from kvpilot.engine.kernels.numerics import FP8_FORMATS, cast_to, fp8_quantize
from kvpilot.engine.kernels.runtime import next_power_of_2, triton_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton_kernel
def _write_kv_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]; uint8 codes when FP8
    v_cache_ptr,
    slot_mapping_ptr,  # [T]
    k_scale_ptr,  # [KVH] float32, only when FP8
    v_scale_ptr,
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
    FP8: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
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
    if FP8:
        k_scale = tl.load(k_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        v_scale = tl.load(v_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        k = fp8_quantize(k, k_scale[:, None], FP8_MANT, FP8_BIAS, FP8_MAX)
        v = fp8_quantize(v, v_scale[:, None], FP8_MANT, FP8_BIAS, FP8_MAX)
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
        and (k_cache.dtype in SUPPORTED_DTYPES or k_cache.dtype in FP8_FORMATS)
        and key.stride(-1) == 1
        and k_cache.stride(-1) == 1
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store key[t], value[t] at slot_mapping[t] = block * block_size + offset. The slots are not
    checked (that would read them back on the host): each must lie in the cache.

    key/value: [T, KVH, D]; k_cache/v_cache: [num_blocks, block_size, KVH, D], written in place;
    k_scale/v_scale: [KVH] float32, given exactly when the caches are FP8 (kv_quant.quantize).
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
    fp8 = check_fp8_scales(k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    fmt = FP8_FORMATS.get(k_cache.dtype)
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    kernel = _write_kv_kernel.on(key.device)
    kernel[(num_tokens,)](
        key,
        value,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping,
        k_scale if fp8 else slot_mapping,  # unread without FP8
        v_scale if fp8 else slot_mapping,
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
        FP8=fp8,
        FP8_MANT=fmt.mant if fmt else 0,
        FP8_BIAS=fmt.bias if fmt else 0,
        FP8_MAX=fp8_max(k_cache.dtype) if fmt else 0.0,
        INTERPRET=key.device.type == "cpu",
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def check_fp8_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """Whether the cache is FP8; its scales must then be float32 [num_kv_heads] on its device, and
    a cache in a plain float dtype takes none."""
    if not is_fp8(k_cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for an FP8 cache, not {k_cache.dtype}")
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (
            s is None
            or s.dtype != torch.float32
            or tuple(s.shape) != (k_cache.shape[2],)
            or s.device != k_cache.device
            or s.stride(0) != 1
        ):
            described = None if s is None else f"{s.dtype} {tuple(s.shape)} on {s.device}"
            raise ValueError(
                f"an FP8 cache needs {name} float32 [{k_cache.shape[2]}] contiguous on "
                f"{k_cache.device}, got {described}"
            )
    return True
