"""Linear layers on CPU with their weights reordered once, at load time, into oneDNN's blocked
layout.

A plain `F.linear` on CPU hands a row-major weight to oneDNN (bfloat16), which may reorder it on
every call, or to MKL's sgemm (float32), which on the development VM runs the model's shapes well
below oneDNN's packed kernels (the lm_head at batch 32: 2.4x). bench/RESULTS.md has both dtypes
for each of the model's shapes. The packed layer replaces the
weight, so memory does not double (but see pack_linears on a tied lm_head).

Numerics: in bfloat16 the packed layer computes the same products bit for bit (on the development
VM; packing_available() insists on an exact match before the engine uses it). In float32 oneDNN
accumulates in another order than MKL: results differ in the last bits (relative 1e-6), which the
greedy-parity tests against transformers cover. Used only where this torch and CPU run oneDNN's
packed linear; anything else keeps nn.Linear.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear in `dtype` and agree with
    F.linear (exactly in bfloat16, to float32 rounding in float32)."""
    if dtype not in PACKED_DTYPES:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 5)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    expected = F.linear(x, weight)
    if dtype == torch.bfloat16:
        return bool(torch.equal(out, expected))
    return bool(torch.allclose(out, expected, rtol=1e-5, atol=1e-5))


class PackedLinear(nn.Module):
    """y = x W^T + b, with W held in oneDNN's layout (the original weight is released)."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedSiluGateUp(nn.Module):
    """silu(x G^T) * (x U^T) from a merged [gate; up] projection, as two oneDNN linears with
    post-ops: the gate's with SiLU (oneDNN's swish), the up's multiplied by that result before it
    is stored. The [tokens, 2 * inter] intermediate never exists.

    Numerics: in bfloat16 the up product is not rounded before the multiply (the separate ops
    round it, and transformers does), so results differ from the unfused path by a bfloat16 ulp
    here and there."""

    # The MLP asks for this instead of knowing the class: its output is already activated.
    fuses_silu_and_mul = True

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        if linear.bias is not None or linear.out_features % 2:
            raise ValueError("a merged gate_up projection has no bias and an even width")
        self.in_features, self.inter = linear.in_features, linear.out_features // 2
        weight = linear.weight.detach()
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.gate = reorder(weight[: self.inter].contiguous(), batch_hint)
        self.up = reorder(weight[self.inter :].contiguous(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        silu_gate = torch.ops.mkldnn._linear_pointwise(x, self.gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, silu_gate, self.up, None, "mul")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, inter={self.inter}, packed, silu*up fused"


def swap_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> int:
    """Replaces every float32 or bfloat16 CPU nn.Linear in `model` by make(attribute name,
    linear); returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.dtype in PACKED_DTYPES
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, make(name, child))
                swapped += 1
    return swapped


def pack_linears(model: nn.Module, batch_hint: int, fuse_gate_up: bool = False) -> int:
    """Swaps every float32 or bfloat16 CPU nn.Linear in `model` for a PackedLinear; returns how
    many. A tied lm_head is packed too (the largest single matmul of a decode step): its packed
    copy costs one extra vocab x hidden matrix, since the embedding keeps the original.

    fuse_gate_up: each MLP's merged gate_up_proj becomes a PackedSiluGateUp instead."""

    def make(name: str, linear: nn.Linear) -> nn.Module:
        fused = fuse_gate_up and name == "gate_up_proj"
        return (PackedSiluGateUp if fused else PackedLinear)(linear, batch_hint)

    return swap_linears(model, make)
