"""The attention contract: one mixed batch (prefill chunks and decodes) over a paged KV cache.

Layout, shared by every backend:
- query:   [num_tokens, num_heads, head_dim]; the sequences of the batch laid end to end.
- key/value (new tokens): [num_tokens, num_kv_heads, head_dim].
- k_cache/v_cache (one layer): [num_blocks, block_size, num_kv_heads, head_dim].
- Token j of sequence s sits at absolute position seq_lens[s] - query_len[s] + j and attends
  causally to positions 0..that position of its own sequence, through block_tables[s].
- slot_mapping[t] = block_id * block_size + offset: where new token t's key and value are written.
  The KV write happens before attention, so a chunk attends to itself through the cache.
- k_scale/v_scale: [num_kv_heads] float32 on the cache's device when the cache is FP8
  (kv_quant.py: stored = fp8(x / scale[head]), read = float(stored) * scale[head]); None for a
  cache in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    # Host copies, so that backends that loop on the host never synchronize with the device.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def fp8_refusal(backend_name: str) -> str:
    return (
        f"the {backend_name} attention backend does not read an FP8 KV cache: use "
        "--kv-cache-dtype auto, or --attention-backend torch (or cpu on CPU)"
    )


class AttentionBackend(Protocol):
    name: str
    reads_fp8: bool  # whether write_kv and forward take an FP8 cache with its scales

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
        """Store each new token's key and value in its slot of the paged cache (in place)."""
        ...

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
        """Causal attention of every query token over its sequence's cached keys: [num_tokens, H,
        D]."""
        ...
