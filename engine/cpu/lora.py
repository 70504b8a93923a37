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


@functools.lru_cache(maxsize=64)
def _bounds_array(bounds: tuple[int, ...]) -> ctypes.Array[ctypes.c_int64]:
    # A handful of distinct bounds per model (one per projection shape): made once each.
    return (ctypes.c_int64 * len(bounds))(*bounds)


def kernel_takes(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    token_slots: torch.Tensor,
) -> bool:
    """Whether lora_add_* takes these tensors: CPU, one dtype the library is built for, the
    layout of kvpilot.engine.lora.ops with unit column strides, and its multiples of 8."""
    dtype = out.dtype
    if not (
        out.is_cpu
        and dtype in SUFFIXES
        and x.dtype == dtype
        and lora_a.dtype == dtype
        and lora_b.dtype == dtype
        and x.is_cpu
        and lora_a.is_cpu
        and lora_b.is_cpu
        and token_slots.is_cpu
        and out.dim() == 2
        and x.dim() == 2
        and lora_a.dim() == 4
        and lora_b.dim() == 3
        and token_slots.dtype == torch.int64
        and token_slots.is_contiguous()
    ):
        return False
    num_slots, num_sub, rank, in_features = lora_a.shape
    tokens, out_features = out.shape
    return (
        x.shape == (tokens, in_features)
        and lora_b.shape == (num_slots, out_features, rank)
        and token_slots.shape == (tokens,)
        and len(bounds) == num_sub + 1
        and bounds[0] == 0
        and bounds[-1] == out_features
        and all(lo <= hi and lo % LANES == 0 for lo, hi in pairwise(bounds))
        and in_features % LANES == 0
        and rank % LANES == 0
        and 0 < rank <= MAX_RANK
        and x.stride(1) == 1
        and out.stride(1) == 1
        and (tokens <= 1 or out.stride(0) >= out_features)  # rows that overlap would race
        and lora_a.is_contiguous()
        and lora_b.is_contiguous()
    )


def add_lora(
    lib: ctypes.CDLL,
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    token_slots: torch.Tensor,
) -> None:
    """out[t] += the delta of token t's slot (-1: none), in place; the tensors as kernel_takes
    accepts them. IndexError for a slot outside the stack (out untouched)."""
    num_slots, num_sub, rank, in_features = lora_a.shape
    tokens, out_features = out.shape
    status = getattr(lib, f"lora_add_{SUFFIXES[out.dtype]}")(
        out.data_ptr(),
        x.data_ptr(),
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        token_slots.data_ptr(),
        _bounds_array(tuple(bounds)),
        tokens,
        num_slots,
        num_sub,
        rank,
        in_features,
        out_features,
        x.stride(0),
        out.stride(0),
    )
    if status == 1:
        raise IndexError(f"a token's LoRA slot is outside the stack of {num_slots} slots")
    if status:
        raise MemoryError("the LoRA kernel could not allocate its scratch memory")
