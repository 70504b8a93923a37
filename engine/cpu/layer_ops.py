"""The decoder's elementwise steps through the C kernels, with the signatures of
kvpilot.engine.model.layers (and write_kv_reference), falling back to those torch versions for
anything the kernels do not take: another dtype, a layout whose last dimension is not contiguous,
or no compiled library at all.

The C versions compute in float32 and round to the storage dtype where the torch ops round; the
tests compare them with the torch versions directly.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.engine.attention.torch_ref import write_kv_reference
from kvpilot.engine.cpu.build import SUFFIXES, load_library
from kvpilot.engine.model import layers
from kvpilot.engine.model.llama import LayerOps

MAX_HIDDEN = 16384


def _takes(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in SUFFIXES
        and all(t.dtype == first.dtype and t.stride(-1) == 1 for t in tensors)
    )


def rms_norm(
    lib: ctypes.CDLL | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    extra = () if residual is None else (residual,)
    if (
        lib is None
        or x.dim() != 2
        or hidden > MAX_HIDDEN
        or not _takes(x, weight, *extra)
        or not weight.is_contiguous()
        or (residual is not None and not residual.is_contiguous())
    ):
        return layers.rms_norm(x, weight, eps, residual)
    out = torch.empty(x.shape, dtype=x.dtype)
    residual_out = x if residual is None else torch.empty_like(out)
    getattr(lib, f"rms_norm_{SUFFIXES[x.dtype]}")(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        residual_out.data_ptr(),
        x.shape[0],
        hidden,
        x.stride(0),
        eps,
    )
    return out, residual_out


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
    getattr(lib, f"rotary_{SUFFIXES[query.dtype]}")(
        query.data_ptr(),
        key.data_ptr(),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        q_out.data_ptr(),
        k_out.data_ptr(),
        query.shape[0],
        query.shape[1],
        key.shape[1],
        head_dim,
        query.stride(0),
        key.stride(0),
    )
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
    """The C versions bound to the compiled library (each falls back to torch by itself). SiLU-and-
    multiply stays in torch: its vectorized exp beat a C loop on the development VM."""
    lib = load_library()
    if lib is None:
        return LayerOps()
    return LayerOps(
        rms_norm=lambda x, weight, eps, residual=None: rms_norm(lib, x, weight, eps, residual),
        apply_rotary=lambda q, k, positions, cache: apply_rotary(lib, q, k, positions, cache),
    )
