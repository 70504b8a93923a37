"""Block ids, their reference counts and the free queue, in plain Python.

Invariants: every block is either referenced (ref_count > 0, held by one or more block tables) or in
the free queue (ref_count == 0). The free queue's order is the eviction order: its front is reused
first. Blocks whose content nothing can find again go to the front, so reusable content is evicted
last (lazy LRU eviction: a freed block keeps its content until it is reused).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvpilot.engine.kv_cache.prefix_cache import BlockKey


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the prefix cache publishes this block's content
    key: BlockKey | None = None  # the content a hit on block_hash must confirm


class BlockPool:
    def __init__(self, num_blocks: int, on_reuse: Callable[[int], None]) -> None:
        """on_reuse(block_id) runs when a free block is handed out again, before it is
        overwritten (the prefix cache forgets its content there)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._on_reuse = on_reuse

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (unreferenced ones with reusable content included)."""
        return len(self.free_queue)

    def take(self, block_id: int) -> None:
        """One more reference to a block (a prefix hit), free or not."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def pop_free(self) -> int:
        """The front of the free queue, referenced once and emptied of its old content."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._on_reuse(block_id)
        block.ref_count = 1
        return block_id

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:  # nothing can hit it: reuse it first
                self.free_queue.move_to_end(block_id, last=False)

    def check_integrity(self, live: list[Sequence]) -> None:
        """Raises AssertionError unless the ref counts are exactly the live block tables'."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (block, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), block
