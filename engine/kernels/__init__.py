"""Triton kernels for the engine's hot path, each beside a launcher that checks its inputs.

Kernels run compiled on CUDA tensors and under Triton's interpreter on CPU tensors when
TRITON_INTERPRET=1 (see runtime.py); everything else falls back to the torch code in
kvpilot.engine.model.layers and kvpilot.engine.attention.torch_ref, which are also the test oracles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

LAYER_OP_BACKENDS = ("torch", "triton")


class LayerOps(NamedTuple):
    """The decoder's small numeric ops, with the signatures of kvpilot.engine.model.layers."""

    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def get_layer_ops(backend: str) -> LayerOps:
    """'torch': the plain torch ops; 'triton': fused kernels (falling back to torch per call where
    a kernel cannot run). Unpack it or use the fields: `rms_norm, silu_and_mul, apply_rotary = ops`.
    """
    if backend == "torch":
        from kvpilot.engine.model import layers

        return LayerOps(layers.rms_norm, layers.silu_and_mul, layers.apply_rotary)
    if backend == "triton":
        from kvpilot.engine.kernels.activation import silu_and_mul
        from kvpilot.engine.kernels.rms_norm import rms_norm
        from kvpilot.engine.kernels.rotary import apply_rotary

        return LayerOps(rms_norm, silu_and_mul, apply_rotary)
    raise ValueError(f"layer ops backend must be one of {LAYER_OP_BACKENDS}, got {backend!r}")


__all__ = ["LAYER_OP_BACKENDS", "LayerOps", "get_layer_ops"]
