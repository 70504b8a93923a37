"""bfloat16 linear layers on CPU with their weights reordered once, at load time, into oneDNN's
blocked layout.

A plain bfloat16 `F.linear` on CPU hands oneDNN a row-major weight, which it may reorder on every
call; `bench/cpu_matmul_ceiling.py --packed` measures what keeping it reordered is worth for each
of the model's shapes. The packed layer computes the same products (bit for bit on the development
VM; packing_available() insists on an exact match before the engine uses it), and replaces the
weight, so memory does not double (but see pack_linears on a tied lm_head). Used only where
oneDNN supports bfloat16 on this CPU; anything else keeps nn.Linear.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("kvpilot")


def packing_available() -> bool:
    """Whether this torch build and CPU run oneDNN's packed bfloat16 linear, and agree with
    F.linear."""
    try:
        weight = torch.randn(48, 32).to(torch.bfloat16)
        x = torch.randn(5, 32).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 5)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(out, F.linear(x, weight)))


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


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Swaps every bfloat16 CPU nn.Linear in `model` for a PackedLinear; returns how many. A tied
    lm_head is packed too (the largest single matmul of a decode step): its packed copy costs one
    extra vocab x hidden matrix, since the embedding keeps the original."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.dtype == torch.bfloat16
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, PackedLinear(child, batch_hint))
                swapped += 1
    return swapped
