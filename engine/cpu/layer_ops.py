"""Rotary embedding and the KV-cache write through the C kernels, with the signatures of
kvpilot.engine.model.layers.apply_rotary and write_kv_reference, falling back to those torch
versions for anything the kernels do not take: another dtype, a layout whose last dimension is not
contiguous, or no compiled library at all.

The C versions compute in float32 and round to the storage dtype where the torch ops round, so the
results are identical (the tests compare them bit for bit).
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.engine.attention.torch_ref import write_kv_reference
from kvpilot.engine.cpu.build import SUFFIXES, load_library
from kvpilot.engine.model import layers
from kvpilot.engine.model.llama import LayerOps


def _takes(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in SUFFIXES
        and all(t.dtype == first.dtype and t.stride(-1) == 1 for t in tensors)
    )


def apply_rotary(
    lib: ctypes.CDLL | None,
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, like the torch version: new contiguous [T, H, D] and [T, KVH, D]."""
    head_dim = query.shape[-1]
    if (
        lib is None
        or not _takes(query, key)
        or query.stride(1) != head_dim
        or key.stride(1) != head_dim
        or head_dim % 2
        or cos_sin_cache.dtype != torch.float32
        or not cos_sin_cache.is_contiguous()
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
    ):
        return layers.apply_rotary(query, key, positions, cos_sin_cache)
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    out_of_table = getattr(lib, f"rotary_{SUFFIXES[query.dtype]}")(
        query.data_ptr(),
        key.data_ptr(),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        len(cos_sin_cache),
        q_out.data_ptr(),
        k_out.data_ptr(),
        query.shape[0],
        query.shape[1],
        key.shape[1],
        head_dim,
        query.stride(0),
        key.stride(0),
    )
    if out_of_table:  # the kernel checks every position before it reads the table
        raise IndexError(f"rotary positions outside the table of {len(cos_sin_cache)} positions")
    return q_out, k_out


def write_kv(
    lib: ctypes.CDLL | None,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Each new token's key and value into its slot of the paged cache [blocks, block_size, KVH,
    D] (in place); negative slots are skipped."""
    row = key.shape[1] * key.shape[2]
    if (
        lib is None
        or not _takes(key, value, k_cache, v_cache)
        or key.stride(1) != key.shape[2]
        or value.stride(1) != value.shape[2]
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping)
        return
    getattr(lib, f"write_kv_{SUFFIXES[key.dtype]}")(
        key.data_ptr(),
        value.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        row,
        key.stride(0),
        value.stride(0),
    )


def cpu_layer_ops() -> LayerOps:
    """The C versions bound to the compiled library (each falls back to torch by itself).

    RMSNorm and SiLU-and-multiply stay in torch. A C RMSNorm was twice as fast but summed the
    squares in another order than torch's mean: a one-ulp change of the float32 variance that
    bfloat16 rounding turned into different tokens on the real model (torch matches transformers
    bit for bit there). SiLU's vectorized exp in torch beat a C loop on the development VM."""
    lib = load_library()
    if lib is None:
        return LayerOps()
    return LayerOps(
        apply_rotary=lambda q, k, positions, cache: apply_rotary(lib, q, k, positions, cache),
    )
