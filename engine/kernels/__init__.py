"""Triton kernels for the engine's hot path, each beside a launcher that checks its inputs.

Kernels run compiled on CUDA tensors and under Triton's interpreter on CPU tensors when
TRITON_INTERPRET=1 (see runtime.py); everything else falls back to the torch code in
kvpilot.engine.model.layers and kvpilot.engine.attention.torch_ref, which are also the test oracles.
"""

from __future__ import annotations

from kvpilot.engine.model.layer_ops import LayerOps

LAYER_OP_BACKENDS = ("torch", "triton")


def get_layer_ops(backend: str) -> LayerOps:
    """'torch': the plain torch ops; 'triton': fused kernels (falling back to torch per call where
    a kernel cannot run)."""
    if backend == "torch":
        return LayerOps()
    if backend == "triton":
        # Lazy: importing the package must not import Triton.
        from kvpilot.engine.kernels.activation import silu_and_mul
        from kvpilot.engine.kernels.rms_norm import rms_norm
        from kvpilot.engine.kernels.rotary import apply_rotary

        return LayerOps(rms_norm=rms_norm, silu_and_mul=silu_and_mul, apply_rotary=apply_rotary)
    raise ValueError(f"layer ops backend must be one of {LAYER_OP_BACKENDS}, got {backend!r}")


__all__ = ["LAYER_OP_BACKENDS", "get_layer_ops"]
