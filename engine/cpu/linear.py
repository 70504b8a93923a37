"""Linear layers on CPU through kvpilot's own kernel (csrc/linear.c), weights packed once at load.

The kernel streams each 16-column weight panel once per 8 rows, every accumulator in a register:
against oneDNN's packed linear on SmolLM2's 30 layers (bench/RESULTS.md), 1.2-1.6x at
decode batches of 1-32 rows, 1.1-1.2x at 64, level at 512 rows, and 1.03-1.05x at a prefill
step's 2048, whose outputs it writes with streaming stores. So it replaces oneDNN for every batch
size, with one copy of each weight (the original is released, as PackedLinear releases its own).

Numerics: float32 sums in k order per output (oneDNN in another order: the last bits differ);
bfloat16 multiplies pairs exactly and accumulates in float32 (vdpbf16ps), one rounding at the end,
as oneDNN does, in another order. The tests hold both to a float64 reference.

Used where the library has the kernel for the dtype (AVX-512; AVX512_BF16 for bfloat16) and the
layer's shape fits (output width a multiple of 16; in bfloat16 an even input width); any other
linear keeps oneDNN's packed layer, or nn.Linear.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kvpilot.engine.cpu.build import SUFFIXES
from kvpilot.engine.model.cpu_linear import PackedLinear, packing_available, swap_linears

PANEL = 16  # output columns per packed panel (one AVX-512 register of float32)
GROUP = 3 * PANEL  # output columns of one tile, stored together
# kvpilot_linear_available()'s bit for each dtype's kernel
AVAILABLE_BIT = {torch.float32: 1, torch.bfloat16: 2}


def kernel_available(lib: ctypes.CDLL | None, dtype: torch.dtype) -> bool:
    """Whether the compiled library has the linear kernel for `dtype` on this CPU."""
    bit = AVAILABLE_BIT.get(dtype)
    return lib is not None and bit is not None and bool(lib.kvpilot_linear_available() & bit)


def kernel_takes(linear: nn.Linear) -> bool:
    """Whether the kernel's layout fits the layer's shape."""
    weight = linear.weight
    return (
        weight.dtype in AVAILABLE_BIT
        and linear.out_features % PANEL == 0
        and (weight.dtype == torch.float32 or linear.in_features % 2 == 0)
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> linear.c's layout, flat: the columns in groups of 3 panels of 16 (the last 1-3
    panels), each group of width w = 16 * panels as float32 [K, w] or bfloat16 [K/2, w, 2]."""
    n, k = weight.shape
    groups = []
    for start in range(0, n, GROUP):
        block = weight[start : start + GROUP]
        if weight.dtype == torch.float32:
            groups.append(block.t().reshape(-1))
        else:
            groups.append(block.reshape(len(block), k // 2, 2).transpose(0, 1).reshape(-1))
    return torch.cat(groups)


class KernelLinear(nn.Module):
    """y = x W^T + b through linear.c, with W in its packed layout (the original is released)."""

    def __init__(self, lib: ctypes.CDLL, linear: nn.Linear) -> None:
        super().__init__()
        if not (kernel_available(lib, linear.weight.dtype) and kernel_takes(linear)):
            raise ValueError(f"the linear kernel does not take {linear} in {linear.weight.dtype}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = pack_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self._dtype = self.packed_weight.dtype
        self._kernel = getattr(lib, f"linear_{SUFFIXES[self._dtype]}")
        # Packed once and never moved: the pointers are fixed for the layer's life.
        self._weight_ptr = self.packed_weight.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ~120 calls per decode step: the checks and views are the cheap ones (a 2-D contiguous
        # input, the engine's case, is neither reshaped nor copied: ~4 us less per call).
        dtype, shape = self._dtype, x.shape
        if x.dtype != dtype or not x.is_cpu or shape[-1] != self.in_features:
            raise TypeError(
                f"KernelLinear({self.in_features} -> {self.out_features}, {dtype}) got "
                f"{tuple(shape)} {x.dtype} on {x.device}"
            )
        flat = x.dim() == 2
        rows = x if flat else x.reshape(-1, self.in_features)
        num_rows, row_stride = rows.shape[0], rows.stride(0)
        if rows.stride(1) != 1 or (num_rows > 1 and row_stride < self.in_features):
            rows = rows.contiguous()
            row_stride = self.in_features
        out = torch.empty((num_rows, self.out_features), dtype=dtype)
        failed = self._kernel(
            rows.data_ptr(),
            self._weight_ptr,
            self._bias_ptr,
            out.data_ptr(),
            num_rows,
            self.out_features,
            self.in_features,
            row_stride,
            self.out_features,
        )
        if failed:  # checked at construction; a library without the kernel would say so here
            raise RuntimeError(f"the linear kernel for {dtype} is not in this build")
        return out if flat else out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, kvpilot kernel"
        )


def use_kernel_linears(
    model: nn.Module, lib: ctypes.CDLL | None, dtype: torch.dtype, batch_hint: int
) -> int:
    """Swaps the model's CPU linears for KernelLinear where the kernel takes them, for oneDNN's
    PackedLinear elsewhere (when this torch has it); returns how many took the kernel, 0 (and
    nothing swapped) when the library has no kernel for `dtype`."""
    if not kernel_available(lib, dtype):
        return 0
    assert lib is not None
    onednn = packing_available(dtype)

    def make(_: str, linear: nn.Linear) -> nn.Module:
        if kernel_takes(linear):
            return KernelLinear(lib, linear)
        return PackedLinear(linear, batch_hint) if onednn else linear

    swap_linears(model, make)
    return sum(isinstance(m, KernelLinear) for m in model.modules())
