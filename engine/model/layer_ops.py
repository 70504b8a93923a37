"""LayerOps: the decoder's small elementwise ops, as the model receives them.

The one definition, in a module that imports only torch and the torch reference ops, so that the
model, the C kernels (kvpilot.engine.cpu) and the Triton kernels (kvpilot.engine.kernels) can all
depend on it without depending on each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvpilot.engine.model import layers

# Each returns None where its kernel does not apply (the model then runs the separate ops).
SiluAndMulLinear = Callable[[torch.Tensor, nn.Module], torch.Tensor | None]
Linear = Callable[[torch.Tensor, nn.Module], torch.Tensor | None]
# (query, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping) -> rotated query
RotaryWriteKv = Callable[..., torch.Tensor | None]
WriteKv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class LayerOps:
    """RMSNorm(+residual), SiLU-and-multiply and rotary, with the signatures of
    kvpilot.engine.model.layers; the defaults are those torch versions, and each backend swaps in
    its own for the ops it implements.

    A backend may also run a projection itself (linear), fuse SiLU-and-mul into the projection
    after it (silu_and_mul_linear) or write the rotated key straight into the KV cache
    (rotary_write_kv); the model goes through project / activate_then_project /
    rotate_and_write_kv, which fall back to the separate ops (and nn.Module calls)."""

    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = layers.rms_norm
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = layers.silu_and_mul
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = layers.apply_rotary
    silu_and_mul_linear: SiluAndMulLinear | None = None
    linear: Linear | None = None
    rotary_write_kv: RotaryWriteKv | None = None

    def activate_then_project(self, gate_up: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        """proj(silu(gate) * up) from the merged gate_up projection's output."""
        if self.silu_and_mul_linear is not None:
            fused = self.silu_and_mul_linear(gate_up, proj)
            if fused is not None:
                return fused
        return proj(self.silu_and_mul(gate_up))

    def project(self, x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        """proj(x), through the backend's own projection kernel where it applies."""
        if self.linear is not None:
            out = self.linear(x, proj)
            if out is not None:
                return out
        return proj(x)

    def rotate_and_write_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        write_kv: WriteKv,
    ) -> torch.Tensor:
        """Rotary on query and key, the rotated key and the value into their cache slots
        (write_kv: the attention backend's, used when not fused); returns the rotated query."""
        k_cache, v_cache = kv_cache
        if self.rotary_write_kv is not None:
            rotated = self.rotary_write_kv(
                query, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
            )
            if rotated is not None:
                return rotated
        query, key = self.apply_rotary(query, key, positions, cos_sin_cache)
        write_kv(key, value, k_cache, v_cache, slot_mapping)
        return query
