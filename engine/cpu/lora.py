"""The batched LoRA delta on CPU through csrc/lora.c: one call per projection adds every token's
own adapter's B(A x) to the projection's output in place (the definition and the layout:
kvpilot.engine.lora.ops).

The kernel groups the tokens by slot into tiles of up to 4, so each row of A and B is read once
per tile; float32 sums, one rounding per output element. Its vector path wants K, the rank and
every sub-projection's bound in multiples of 8 (AVX2: 8 float32 lanes); anything it does not take
is left to the caller's torch path (kernel_takes says which).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from itertools import pairwise

import torch

from kvpilot.engine.cpu.build import SUFFIXES

LANES = 8  # the kernel's vector width (float32 lanes): K, the rank and the bounds step by it
MAX_RANK = 256  # the kernel's stack buffer of one 8-column block of B holds 8 x 256 floats


BoundsArray = ctypes.Array[ctypes.c_int64]


@functools.lru_cache(maxsize=64)
def _bounds_array(bounds: tuple[int, ...]) -> BoundsArray | None:
    """The bounds as the C array the kernel reads, or None when the kernel does not take them
    (not ascending from 0, or a bound off the 8-lane grid). A handful of distinct bounds per model
    (one per projection shape): each checked and made once."""
    if not bounds or bounds[0] != 0 or any(lo > hi or hi % LANES for lo, hi in pairwise(bounds)):
        return None
    return (ctypes.c_int64 * len(bounds))(*bounds)


def _arguments(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    token_slots: torch.Tensor,
) -> tuple[object, ...] | None:
    """lora_add_*'s arguments after the pointers, or None when the kernel does not take these
    tensors. Runs once per projection per step, so it reads each attribute once (~120 calls a
    step: every check costs)."""
    dtype = out.dtype
    if not (
        dtype in SUFFIXES
        and x.dtype == dtype
        and lora_a.dtype == dtype
        and lora_b.dtype == dtype
        and token_slots.dtype == torch.int64
        and out.is_cpu
        and x.is_cpu
        and lora_a.is_cpu
        and lora_b.is_cpu
        and token_slots.is_cpu
    ):
        return None
    bounds_array = _bounds_array(tuple(bounds))
    try:
        tokens, out_features = out.shape
        num_slots, num_sub, rank, in_features = lora_a.shape
        out_stride, out_column = out.stride()
        x_stride, x_column = x.stride()
    except ValueError:  # not 2-D, or lora_a not 4-D
        return None
    if (
        bounds_array is None
        or len(bounds_array) != num_sub + 1
        or bounds_array[num_sub] != out_features
        or x.shape != (tokens, in_features)
        or lora_b.shape != (num_slots, out_features, rank)
        or token_slots.shape != (tokens,)
        or in_features % LANES
        or rank % LANES
        or not 0 < rank <= MAX_RANK
        or x_column != 1
        or out_column != 1
        or (tokens > 1 and out_stride < out_features)  # rows that overlap would race
        or not (lora_a.is_contiguous() and lora_b.is_contiguous() and token_slots.is_contiguous())
    ):
        return None
    return (
        bounds_array,
        tokens,
        num_slots,
        num_sub,
        rank,
        in_features,
        out_features,
        x_stride,
        out_stride,
    )


def kernel_takes(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    token_slots: torch.Tensor,
) -> bool:
    """Whether lora_add_* takes these tensors: CPU, one dtype the library is built for, the
    layout of kvpilot.engine.lora.ops with unit column strides, K, the rank and the bounds in
    multiples of 8, token_slots int64 and contiguous."""
    return _arguments(out, x, lora_a, lora_b, bounds, token_slots) is not None


def add_lora(
    lib: ctypes.CDLL,
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    token_slots: torch.Tensor,
) -> bool:
    """out[t] += the delta of token t's slot (-1: none), in place, and True; False (nothing done)
    when the kernel does not take these tensors (kernel_takes). IndexError for a slot outside the
    stack (out untouched)."""
    arguments = _arguments(out, x, lora_a, lora_b, bounds, token_slots)
    if arguments is None:
        return False
    status = getattr(lib, f"lora_add_{SUFFIXES[out.dtype]}")(
        out.data_ptr(),
        x.data_ptr(),
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        token_slots.data_ptr(),
        *arguments,
    )
    if status == 1:
        raise IndexError(f"a token's LoRA slot is outside the stack of {arguments[2]} slots")
    if status:
        raise MemoryError("the LoRA kernel could not allocate its scratch memory")
    return True
