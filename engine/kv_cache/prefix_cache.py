"""Prefix caching by chained block hashes (the contract in base.PrefixCache).

A full block's key is (its parent block's hash, its token ids, the request's cache_salt, its LoRA
adapter); a block inside the prefix the request marks as shared with every tenant has no salt
(contract.tenancy.unsalted_blocks). Its hash is the contract's hash_block of that key, the same one
the router computes to predict hits. A hash is only a pointer: a hit is confirmed by comparing the
stored key, so a 64-bit collision never serves another prompt's KV. Published blocks live in the
pool's free queue once unreferenced and are forgotten only when the pool reuses them.
"""

from __future__ import annotations

from typing import NamedTuple

from kvpilot.contract.block_hash import block_salt, hash_block
from kvpilot.contract.kv_events import KvDelta
from kvpilot.contract.tenancy import unsalted_blocks
from kvpilot.engine.kv_cache.base import PrefixCache
from kvpilot.engine.kv_cache.block_pool import Block
from kvpilot.engine.sequence import Sequence


class BlockKey(NamedTuple):
    parent: int | None
    token_ids: tuple[int, ...]
    cache_salt: str | None
    lora_name: str | None


def block_key(seq: Sequence, index: int, block_size: int) -> BlockKey:
    parent = seq.block_hashes[index - 1] if index > 0 else None
    start = index * block_size
    salt = block_salt(seq.cache_salt, index, unsalted_blocks(seq.shared_prefix_tokens, block_size))
    return BlockKey(parent, tuple(seq.token_ids[start : start + block_size]), salt, seq.lora_name)


def update_block_hashes(seq: Sequence, block_size: int) -> None:
    """Extends the sequence's hash chain over every full block of its known tokens."""
    num_full = seq.num_known_tokens // block_size
    for index in range(len(seq.block_hashes), num_full):
        seq.block_hashes.append(hash_block(*block_key(seq, index, block_size)))


class HashPrefixCache(PrefixCache):
    def __init__(self, blocks: list[Block], block_size: int) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # block hash -> published (True) or not (False) since the last drain; the last change wins.
        self._changes: dict[int, bool] = {}

    def match(self, seq: Sequence) -> list[int]:
        update_block_hashes(seq, self.block_size)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for index in range(max_blocks):
            block_id = self.cached.get(seq.block_hashes[index])
            if block_id is None or self.blocks[block_id].key != block_key(
                seq, index, self.block_size
            ):
                break
            hits.append(block_id)
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def publish(self, seq: Sequence) -> None:
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_published_blocks:  # a decode step mostly fills no new block
            return
        update_block_hashes(seq, self.block_size)
        for index in range(seq.num_published_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is not None:
                continue
            block_hash = seq.block_hashes[index]
            if block_hash in self.cached:
                continue  # another block computed the same content first; this one stays private
            block.block_hash = block_hash
            block.key = block_key(seq, index, self.block_size)
            self.cached[block_hash] = block.block_id
            self._changes[block_hash] = True
        seq.num_published_blocks = num_full

    def evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) == block_id:
            del self.cached[block.block_hash]
            self._changes[block.block_hash] = False
        _forget(block)

    def reset(self) -> None:
        for block_hash, block_id in list(self.cached.items()):
            if self.blocks[block_id].ref_count == 0:
                _forget(self.blocks[block_id])
                del self.cached[block_hash]
                self._changes[block_hash] = False

    def drain_events(self) -> KvDelta | None:
        if not self._changes:
            return None
        changes, self._changes = self._changes, {}
        return KvDelta(
            stored=[h for h, is_cached in changes.items() if is_cached],
            removed=[h for h, is_cached in changes.items() if not is_cached],
        )

    def check_integrity(self) -> None:
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash


class NoPrefixCache(PrefixCache):
    """Prefix caching off: nothing is published, nothing matches, nothing is counted."""

    def __init__(self) -> None:
        self.cached: dict[int, int] = {}  # always empty
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def match(self, seq: Sequence) -> list[int]:
        return []

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        pass

    def publish(self, seq: Sequence) -> None:
        pass

    def evict(self, block_id: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def drain_events(self) -> KvDelta | None:
        return None

    def check_integrity(self) -> None:
        pass


def _forget(block: Block) -> None:
    block.block_hash = None
    block.key = None
