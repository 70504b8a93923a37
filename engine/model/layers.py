"""The small numeric building blocks of the decoder, in plain torch.

Fused Triton versions (kvpilot.engine.kernels) keep these exact signatures, so the model swaps them
in without knowing which it runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvpilot.engine.config import RopeScaling


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual). With a residual, x + residual is normed and also returned as the
    residual for the next layer; without one, x itself is the residual."""
    if residual is not None:
        x = x + residual
    residual_out = x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), residual_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: silu(gate) * up, gate first (the merged gate_up projection)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64: per row, the index of the first largest value (NaN counts as largest),
    as argmax gives it: on CPU `max(-1)` computes the same indices faster than `argmax(-1)`."""
    return values.max(-1).indices


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
        # blended.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, blended, inv_freq)
    return inv_freq.float()


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: RopeScaling
) -> torch.Tensor:
    """[max_positions, head_dim]: cos of the half-dims then sin of the half-dims, float32."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as HF Llama applies it.

    query: [T, H, D], key: [T, KVH, D], positions: [T] int, cos_sin_cache: [max_pos, D] float32.
    """
    half = query.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(query), rotate(key)
