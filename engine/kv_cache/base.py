"""The KV cache's two contracts: the memory that holds keys and values, and the index that lets a
request reuse blocks another request computed.

A new KV dtype (FP8 with scales) is a new `KVCachePool`; a host-memory tier or another eviction
policy is a new `PrefixCache`. The scheduler sees neither: it calls the block manager, which
allocates over a pool of block ids and consults the prefix cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvpilot.contract.kv_events import KvDelta
    from kvpilot.engine.sequence import Sequence


class KVCachePool(ABC):
    """Per-layer K and V storage for `num_blocks` blocks of `block_size` tokens.

    Invariants: every layer's K and V have the same shape, [num_slots_blocks, block_size,
    num_kv_heads, head_dim] (num_slots_blocks is num_blocks, plus one null block where padded
    steps need somewhere harmless to write); a token's slot is block_id * block_size + offset in
    every layer; block ids are the block manager's.
    """

    num_blocks: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    null_block: int | None

    @property
    @abstractmethod
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of every layer, in layer order: what the attention backends read and write."""

    @property
    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one block takes over every layer (this rank's share under tensor parallelism)."""

    @property
    def scales(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(k_scale, v_scale) of every layer, [num_kv_heads] float32 on `device`, for a quantized
        cache (engine/attention/kv_quant.py); None when K and V are stored as computed."""
        return None


class PrefixCache(ABC):
    """Which full blocks can be reused, and by whom.

    Invariants: only full, computed blocks are published; a block is found only by a sequence
    whose key chain (parent, token ids, cache salt) matches the stored key, not the hash alone; a
    match never covers a sequence's last token (one token is always computed, to sample from); a
    published block stays findable after it is freed, until the pool reuses it (`evict`); every
    change to the set of published hashes is reported by `drain_events`, in order.
    """

    cached: dict[int, int]  # published block hash -> block id
    num_queried_tokens: int
    num_hit_tokens: int

    @abstractmethod
    def match(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest published prefix of seq's tokens."""

    @abstractmethod
    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admission's lookup for the hit-rate metrics."""

    @abstractmethod
    def publish(self, seq: Sequence) -> None:
        """Makes seq's computed full blocks findable by later requests."""

    @abstractmethod
    def evict(self, block_id: int) -> None:
        """The pool is about to overwrite this block: forget what it held."""

    @abstractmethod
    def reset(self) -> None:
        """Forgets every published block no sequence holds."""

    @abstractmethod
    def drain_events(self) -> KvDelta | None:
        """The changes to the published hash set since the last drain (None when none)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raises AssertionError if the index disagrees with the blocks (tests)."""
