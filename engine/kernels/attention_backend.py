"""The 'triton' attention backend: the paged-attention and KV-write kernels behind AttentionBackend.

Tensors the kernels cannot take (CPU without TRITON_INTERPRET=1, unsupported dtypes or layouts) go
to the torch reference, so selecting this backend never changes what the engine can run, only how
fast.
"""

from __future__ import annotations

import torch

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.attention.torch_ref import paged_attention_reference, write_kv_reference
from kvpilot.engine.kernels import attention, kv_cache
from kvpilot.engine.kernels.runtime import can_use_triton


class TritonAttentionBackend:
    """Split-K is chosen per step from occupancy (on CUDA), by attention.paged_attention. An FP8
    cache is written and read by the kernels with its per-head scales (kv_quant.py's format)."""

    name = "triton"
    reads_fp8 = True

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        if can_use_triton(key, value, k_cache, v_cache, slot_mapping) and kv_cache.is_supported(
            key, k_cache
        ):
            kv_cache.write_kv(
                key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
            )
        else:
            write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if can_use_triton(query, k_cache, v_cache) and attention.is_supported(query, k_cache):
            return attention.paged_attention(
                query, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale
            )
        return paged_attention_reference(
            query, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale
        )
