"""Attention over the paged KV cache, behind one small interface (see base.py)."""

from __future__ import annotations

from kvpilot.contract.engine_choices import ATTENTION_BACKEND_NAMES
from kvpilot.engine.attention.base import AttentionBackend, AttentionMetadata
from kvpilot.engine.attention.torch_ref import TorchAttentionBackend


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend named by the engine config ('auto' is resolved there); 'cpu' lives in
    kvpilot.engine.cpu, 'triton' in kvpilot.engine.kernels."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        from kvpilot.engine.cpu.attention_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "triton":
        from kvpilot.engine.kernels.attention_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKEND_NAMES}, got {name!r}")


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "get_attention_backend",
]
