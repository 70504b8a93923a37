"""Matrix-vector products for one-token steps.

At one token a decode step is a chain of matrix-vector products that only stream weights. cuBLAS
runs o_proj and down_proj at one row as split-K GEMMs, each followed by a reduction kernel: a
launch and a gap in the graph per projection (the batch-1 kernel breakdown in bench/RESULTS.md).
Here each projection is one kernel, at the copy bandwidth or above cuBLAS's
(bench/gemv_bandwidth.py):

- PROLOGUE_NONE:  out = x @ W.T (+ bias)
- PROLOGUE_SILU:  out = (silu(gate) * up) @ W.T from the merged [gate | up] input, each program
                  computing the activation of its chunks (rounded as the separate kernel rounds)

Each program streams BLOCK_N rows of W against the (cache-resident) input; accumulation is
float32. Only the summation order differs from the separate ops.

Measured and not kept: an RMSNorm prologue (each program recomputing the norm of the whole input
before its rows, then its normed chunks): at gate_up_proj's 7,168 programs the input traffic
exceeded the weights' and single-stream decoding fell from 208 to 179 tok/s on an H200.
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import nn

from kvpilot.engine.kernels.numerics import cast_to
from kvpilot.engine.kernels.runtime import can_use_triton, triton_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One-token steps only: at two or more rows cuBLAS reuses each weight tile across rows, which this
# kernel does not.
MAX_ROWS = 1
PROLOGUE_NONE, PROLOGUE_SILU = 0, 1


@triton_kernel
def _gemv_kernel(
    x_ptr,  # [M, K] (PROLOGUE_SILU: [M, 2K], gate then up)
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N], HAS_BIAS only
    out_ptr,  # [M, N] contiguous
    stride_x,
    N,
    K,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    block = tl.program_id(0)
    n_offs = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_offs < N
    k_range = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_x
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + k_range
        k_ok = k_offs < K
        x = tl.load(x_row + k_offs, mask=k_ok, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            up = tl.load(x_row + K + k_offs, mask=k_ok, other=0.0).to(tl.float32)
            act = cast_to(x / (1.0 + tl.exp(-x)), dtype, INTERPRET).to(tl.float32)
            x = cast_to(act * up, dtype, INTERPRET).to(tl.float32)
        w = tl.load(
            w_ptr + n_offs[:, None].to(tl.int64) * K + k_offs[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n_offs, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + n_offs, cast_to(out, dtype, INTERPRET), mask=n_ok)


def _weights_of(linear: nn.Module, x: torch.Tensor, in_features: int) -> bool:
    """Whether `linear` is a plain nn.Linear this kernel can stream for input x."""
    if type(linear) is not nn.Linear:  # packed CPU modules and the like keep their own forward
        return False
    w = linear.weight
    bias = linear.bias
    return (
        w.dtype == x.dtype
        and w.dim() == 2
        and w.shape[1] == in_features
        and w.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and w.device == x.device
    )


def _eligible(x: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in SUPPORTED_DTYPES
        and x.stride(-1) == 1
        and can_use_triton(x)
    )


def _tile(k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from bench/gemv_bandwidth.py's sweep on an H200: 4 rows of
    1024 keys with 8 warps at hidden-size inputs, 8 rows with 4 warps at intermediate-size ones.
    The interpreter runs each program in numpy: fewer, wider programs are faster there."""
    if device.type == "cpu":
        return 64, 256, 4
    return (8, 1024, 4) if k > 8192 else (4, 1024, 8)


def _launch(x: torch.Tensor, linear: nn.Linear, k: int, prologue: int) -> torch.Tensor:
    w = linear.weight
    n = w.shape[0]
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _tile(k, x.device)
    kernel = _gemv_kernel.on(x.device)
    kernel[(-(-n // block_n), rows)](
        x,
        w,
        linear.bias if linear.bias is not None else w,
        out,
        x.stride(0),
        n,
        k,
        PROLOGUE=prologue,
        HAS_BIAS=linear.bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        INTERPRET=x.device.type == "cpu",
        num_warps=warps,
    )
    return out


def linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor | None:
    """module(x) as one matrix-vector kernel, or None where it does not apply (then call module)."""
    if not (_eligible(x) and _weights_of(module, x, x.shape[-1])):
        return None
    assert isinstance(module, nn.Linear)
    return _launch(x, module, x.shape[-1], PROLOGUE_NONE)


def silu_and_mul_linear(gate_up: torch.Tensor, module: nn.Module) -> torch.Tensor | None:
    """module(silu(gate) * up) in one kernel from the merged [gate | up] rows; None where it does
    not apply."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2 or not _eligible(gate_up):
        return None
    k = gate_up.shape[-1] // 2
    if not _weights_of(module, gate_up, k):
        return None
    assert isinstance(module, nn.Linear)
    return _launch(gate_up, module, k, PROLOGUE_SILU)
