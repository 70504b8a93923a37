"""Paged KV-cache bookkeeping with prefix caching, in plain Python (no torch).

Invariants:
- Every block is either referenced (ref_count > 0, held by one or more block tables) or in the free
  queue (ref_count == 0). The free queue's order is the eviction order: its front is reused first.
- A freed block keeps its hash (and stays findable by prefix lookup) until it is reused: lazy LRU
  eviction. Freed blocks without a hash go to the front, since nothing can hit them.
- Only full blocks are hashed. A hash chains the parent block's hash, the block's token ids and the
  request's cache_salt; a lookup hit is confirmed by comparing that stored key, not just the hash.
- A prefix lookup never covers a sequence's last token: one token must always be computed, to sample
  from.
- Every change to the set of cached hashes (`cached`'s keys) is recorded for drain_kv_events(), so
  a mirror that applies the drained deltas in order holds exactly that set (block_events.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvpilot.contract.block_hash import hash_block as hash_block_key
from kvpilot.contract.kv_events import KvDelta
from kvpilot.engine.sequence import Sequence

BlockKey = tuple[int | None, tuple[int, ...], str | None]  # (parent hash, token ids, cache salt)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    key: BlockKey | None = None


def hash_block(key: BlockKey) -> int:
    return hash_block_key(*key)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # block hash -> cached (True) or not (False) since the last drain; the last change wins.
        self._kv_changes: dict[int, bool] = {}

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------
    def block_key(self, seq: Sequence, index: int) -> BlockKey:
        parent = seq.block_hashes[index - 1] if index > 0 else None
        start = index * self.block_size
        return parent, tuple(seq.token_ids[start : start + self.block_size]), seq.cache_salt

    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend the sequence's hash chain over every full block of its known tokens."""
        num_full = seq.num_known_tokens // self.block_size
        for index in range(len(seq.block_hashes), num_full):
            seq.block_hashes.append(hash_block(self.block_key(seq, index)))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq (never its last token)."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for index in range(max_blocks):
            block_id = self.cached.get(seq.block_hashes[index])
            if block_id is None or self.blocks[block_id].key != self.block_key(seq, index):
                break
            hits.append(block_id)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's computed full blocks for reuse by later requests."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_published_blocks:  # a decode step mostly fills no new block
            return
        self.update_block_hashes(seq)
        for index in range(seq.num_published_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is not None:
                continue
            block_hash = seq.block_hashes[index]
            if block_hash in self.cached:
                continue  # another block computed the same content first; this one stays private
            block.block_hash = block_hash
            block.key = self.block_key(seq, index)
            self.cached[block_hash] = block.block_id
            self._kv_changes[block_hash] = True
        seq.num_published_blocks = num_full

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()
    ) -> bool:
        needed = self._num_fresh_blocks(seq, num_new_tokens, len(cached_blocks))
        reclaimable = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return needed <= self.num_free_blocks - reclaimable

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
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
                self._take(block_id)
            seq.block_table.extend(cached_blocks)
        for _ in range(num_fresh):
            seq.block_table.append(self._pop_free())
        return True

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks. The tail goes back first, so it is evicted before the head,
        which other requests are likelier to share."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.num_published_blocks = 0

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self.cached.items()):
            if self.blocks[block_id].ref_count == 0:
                self._forget(self.blocks[block_id])
                del self.cached[block_hash]
                self._kv_changes[block_hash] = False

    def drain_kv_events(self) -> KvDelta | None:
        """The changes to the cached hash set since the last drain (None when there are none)."""
        if not self._kv_changes:
            return None
        changes, self._kv_changes = self._kv_changes, {}
        return KvDelta(
            stored=[h for h, is_cached in changes.items() if is_cached],
            removed=[h for h, is_cached in changes.items() if not is_cached],
        )

    # ---- internals -----------------------------------------------------------------------------
    def _num_fresh_blocks(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int) -> int:
        num_computed = (
            num_cached_blocks * self.block_size if num_cached_blocks else seq.num_computed_tokens
        )
        total = self.num_blocks_for(num_computed + num_new_tokens)
        return max(0, total - len(seq.block_table) - num_cached_blocks)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                self._kv_changes[block.block_hash] = False
            self._forget(block)
        block.ref_count = 1
        return block_id

    @staticmethod
    def _forget(block: Block) -> None:
        block.block_hash = None
        block.key = None

    def check_integrity(self, live: list[Sequence]) -> None:
        """Raises AssertionError if the books do not balance (used by tests)."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (block, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), block
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash
