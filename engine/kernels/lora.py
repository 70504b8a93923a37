"""The batched LoRA delta of one projection on CUDA (Punica's shrink/expand over S-LoRA's
segments): out[t] += B[s] (A[s] x[t]) for every token t with slot s >= 0, in place (the definition
and the layout: kvpilot.engine.lora.ops).

Two launches, both over (token tile, slot) pairs, so the host needs no sorted order or segment
list and reads nothing back from the device (CUDA-graph safe): a program keeps only its tile's
tokens of its slot and exits at once when there are none. A prefill chunk's tokens are one run of
one slot, a decode batch's tokens of one slot fall in one or two tiles; either way each tile reads
its adapter's A and B rows once for all its tokens of that slot.
- shrink, grid (tiles, slots, subs): h[t, sub's rank columns] = x[t] A[s, sub]^T, float32;
- expand, grid (tiles, slots, column blocks): out[t, block] += h[t] B[s, block]^T, for the subs
  the block meets, then one rounding to out's dtype.

Numerics: the shrink's products run on the tensor cores in bfloat16/float16 (float32 sums), in
IEEE float32 for float32 inputs; h stays float32 and the expand runs in IEEE float32, so the delta
is rounded once, when it is added to out (the C kernel's semantics). Under the interpreter every
product is float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import triton.language as tl

from kvpilot.engine.kernels.numerics import cast_to
from kvpilot.engine.kernels.runtime import can_use_triton, next_power_of_2, triton_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_K = 64  # input features per step of the shrink
BLOCK_N = 64  # output columns per expand program
# Sub-projections per projection the expand takes (qkv has 3): their bounds are scalar
# arguments, so no tensor of them need reach the device.
MAX_SUB = 4


@triton_kernel(do_not_specialize=("num_tokens",))
def _shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, num_sub, rank, K]
    slots_ptr,  # [T] int64
    h_ptr,  # [T, num_sub * rank] float32
    num_tokens,
    K,
    stride_x,
    stride_as,
    stride_ai,
    RANK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.program_id(1)
    sub = tl.program_id(2)
    slots = tl.load(slots_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    mine = slots == slot
    if tl.max(mine.to(tl.int32), 0) > 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < RANK
        a_base = a_ptr + slot.to(tl.int64) * stride_as + sub * stride_ai
        h = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(
                x_ptr + offs_t[:, None] * stride_x + offs_k[None, :],
                mask=mine[:, None] & k_ok[None, :],
                other=0.0,
            )  # [BLOCK_T, BLOCK_K]
            a = tl.load(
                a_base + offs_r[None, :] * K + offs_k[:, None],
                mask=r_ok[None, :] & k_ok[:, None],
                other=0.0,
            )  # [BLOCK_K, BLOCK_R]
            if UPCAST:
                h += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                h += tl.dot(x, a)
        width = tl.num_programs(2) * RANK
        tl.store(
            h_ptr + offs_t[:, None] * width + sub * RANK + offs_r[None, :],
            h,
            mask=mine[:, None] & r_ok[None, :],
        )


@triton_kernel(do_not_specialize=("num_tokens",))
def _expand_kernel(
    out_ptr,  # [T, N]
    h_ptr,  # [T, num_sub * rank] float32
    b_ptr,  # [num_slots, N, rank]
    slots_ptr,  # [T] int64
    bound1,  # the subs' ends in N: bounds[1:], padded with N to MAX_SUB
    bound2,
    bound3,
    bound4,
    num_tokens,
    N,
    stride_out,
    stride_bs,
    RANK: tl.constexpr,
    NUM_SUB: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    slots = tl.load(slots_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    mine = slots == slot
    if tl.max(mine.to(tl.int32), 0) > 0:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < RANK
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(NUM_SUB):
            if i == 0:
                lo, hi = 0, bound1
            elif i == 1:
                lo, hi = bound1, bound2
            elif i == 2:
                lo, hi = bound2, bound3
            else:
                lo, hi = bound3, bound4
            if (lo < n0 + BLOCK_N) & (hi > n0):  # this block's columns meet sub i
                h = tl.load(
                    h_ptr + offs_t[:, None] * (NUM_SUB * RANK) + i * RANK + offs_r[None, :],
                    mask=mine[:, None] & r_ok[None, :],
                    other=0.0,
                )  # [BLOCK_T, BLOCK_R]
                in_sub = (offs_n >= lo) & (offs_n < hi)
                b = tl.load(
                    b_base + offs_n[None, :] * RANK + offs_r[:, None],
                    mask=r_ok[:, None] & in_sub[None, :],
                    other=0.0,
                )  # [BLOCK_R, BLOCK_N]
                acc += tl.dot(h, b.to(tl.float32), input_precision="ieee")
        o_mask = mine[:, None] & (offs_n < N)[None, :]
        o_ptrs = out_ptr + offs_t[:, None] * stride_out + offs_n[None, :]
        total = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32) + acc
        tl.store(o_ptrs, cast_to(total, out_ptr.dtype.element_ty, INTERPRET), mask=o_mask)


def triton_takes(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    token_slots: torch.Tensor,
) -> bool:
    """Whether the kernels take these tensors: one device Triton runs on, one supported dtype,
    lora_a and lora_b contiguous in kvpilot.engine.lora.ops's layout, x and out with unit column
    strides, token_slots int64 and contiguous."""
    if not (
        can_use_triton(out, x, lora_a, lora_b, token_slots)
        and out.dtype in SUPPORTED_DTYPES
        and x.dtype == lora_a.dtype == lora_b.dtype == out.dtype
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
        and num_sub <= MAX_SUB
        and bounds[0] == 0
        and bounds[-1] == out_features
        and all(lo <= hi for lo, hi in pairwise(bounds))
        and rank > 0
        and x.stride(1) == 1
        and out.stride(1) == 1
        and lora_a.is_contiguous()
        and lora_b.is_contiguous()
    )


def block_tokens(tokens: int) -> int:
    """Tokens per tile: 16 (tl.dot's smallest) for decode batches, more for prefill chunks."""
    return 16 if tokens <= 128 else 64


def add_lora_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    token_slots: torch.Tensor,
) -> None:
    """out[t] += the delta of token t's slot (-1: none), in place; the tensors as triton_takes
    accepts them (ValueError otherwise). A slot outside the stack matches no program: that token
    gets no delta."""
    if not triton_takes(out, x, lora_a, lora_b, bounds, token_slots):
        raise ValueError(
            f"the LoRA kernels do not take out {tuple(out.shape)} {out.dtype}, x "
            f"{tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, "
            f"bounds {tuple(bounds)} on {out.device}"
        )
    num_slots, num_sub, rank, in_features = lora_a.shape
    tokens, out_features = out.shape
    if tokens == 0:
        return
    device = out.device
    interpret = device.type == "cpu"
    block_t = block_tokens(tokens)
    block_r = max(16, next_power_of_2(rank))
    tiles = -(-tokens // block_t)
    ends = [*bounds[1:], *[out_features] * (MAX_SUB - num_sub)]
    h = torch.empty((tokens, num_sub * rank), dtype=torch.float32, device=device)
    _shrink_kernel.on(device)[(tiles, num_slots, num_sub)](
        x,
        lora_a,
        token_slots,
        h,
        tokens,
        in_features,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        RANK=rank,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
        UPCAST=interpret or x.dtype == torch.float32,
        num_warps=4,
    )
    _expand_kernel.on(device)[(tiles, num_slots, -(-out_features // BLOCK_N))](
        out,
        h,
        lora_b,
        token_slots,
        *ends,
        tokens,
        out_features,
        out.stride(0),
        lora_b.stride(0),
        RANK=rank,
        NUM_SUB=num_sub,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_N=BLOCK_N,
        INTERPRET=interpret,
        num_warps=4,
    )
