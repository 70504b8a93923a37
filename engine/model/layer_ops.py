"""LayerOps: the decoder's small elementwise ops, as the model receives them.

The one definition, in a module that imports only torch and the torch reference ops, so that the
model, the C kernels (kvpilot.engine.cpu) and the Triton kernels (kvpilot.engine.kernels) can all
depend on it without depending on each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.model import layers


@dataclass(frozen=True)
class LayerOps:
    """RMSNorm(+residual), SiLU-and-multiply and rotary, and the greedy sampler's per-row argmax,
    with the signatures of kvpilot.engine.model.layers; the defaults are those torch versions, and
    each backend swaps in its own for the ops it implements."""

    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = layers.rms_norm
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = layers.silu_and_mul
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = layers.apply_rotary
    argmax_rows: Callable[[torch.Tensor], torch.Tensor] = layers.argmax_rows
    # add_lora(out, x, lora_a, lora_b, bounds, mapping): each token's adapter delta added to a
    # projection's output (engine/lora/ops.py); set where the engine serves adapters.
    add_lora: (
        Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int], Any], None]
        | None
    ) = None
