"""What the scheduler calls: each sequence's block table grown, shared and returned, over the
block pool (ref counts, eviction order) and the prefix cache (what can be reused).

Invariants (with those of block_pool.py and base.PrefixCache): a sequence takes a prefix hit only
while its block table is empty; a failed allocation changes nothing; a sequence's blocks are freed
tail first, so its tail is evicted before its head, which other requests are likelier to share.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvpilot.contract.kv_events import KvDelta
from kvpilot.engine.kv_cache.base import PrefixCache
from kvpilot.engine.kv_cache.block_pool import Block, BlockPool
from kvpilot.engine.kv_cache.prefix_cache import HashPrefixCache, NoPrefixCache
from kvpilot.engine.sequence import Sequence


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, on_reuse=self._evict)
        self.prefix_cache: PrefixCache = (
            HashPrefixCache(self.pool.blocks, block_size)
            if enable_prefix_caching
            else NoPrefixCache()
        )

    def _evict(self, block_id: int) -> None:
        self.prefix_cache.evict(block_id)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def free_queue(self) -> Seq[int]:
        return self.pool.free_queue

    @property
    def cached(self) -> dict[int, int]:
        """Published block hash -> block id."""
        return self.prefix_cache.cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_queried_tokens(self) -> int:
        return self.prefix_cache.num_queried_tokens

    @property
    def num_hit_tokens(self) -> int:
        return self.prefix_cache.num_hit_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq (never its last token)."""
        return self.prefix_cache.match(seq)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache.record_query(num_tokens, num_hit_tokens)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's computed full blocks for reuse by later requests."""
        self.prefix_cache.publish(seq)

    def reset_prefix_cache(self) -> None:
        self.prefix_cache.reset()

    def drain_kv_events(self) -> KvDelta | None:
        """The changes to the cached hash set since the last drain (None when there are none)."""
        return self.prefix_cache.drain_events()

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()
    ) -> bool:
        needed = self._num_fresh_blocks(seq, num_new_tokens, len(cached_blocks))
        reclaimable = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        return needed <= self.num_free_blocks - reclaimable

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Grow seq's block table to hold num_new_tokens more tokens, first taking cached_blocks
        (a prefix hit, only when the table is empty). False, changing nothing, if blocks run out."""
        if not cached_blocks and (
            seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size
        ):
            return True  # most decode steps: the last block has room
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            return False
        num_fresh = self._num_fresh_blocks(seq, num_new_tokens, len(cached_blocks))
        if cached_blocks:
            assert not seq.block_table, "a prefix hit is only taken by a sequence without blocks"
            for block_id in cached_blocks:
                self.pool.take(block_id)
            seq.block_table.extend(cached_blocks)
        for _ in range(num_fresh):
            seq.block_table.append(self.pool.pop_free())
        return True

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks, tail first."""
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        seq.block_table.clear()
        seq.num_published_blocks = 0

    def _num_fresh_blocks(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int) -> int:
        num_computed = (
            num_cached_blocks * self.block_size if num_cached_blocks else seq.num_computed_tokens
        )
        total = self.num_blocks_for(num_computed + num_new_tokens)
        return max(0, total - len(seq.block_table) - num_cached_blocks)

    def check_integrity(self, live: list[Sequence]) -> None:
        """Raises AssertionError if the books do not balance (used by tests)."""
        self.pool.check_integrity(live)
        self.prefix_cache.check_integrity()
