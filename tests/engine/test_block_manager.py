"""Exact bookkeeping of the block manager: block ids, reference counts, eviction order, salts."""

from __future__ import annotations

import pytest

from kvpilot.engine.kv_cache.block_manager import BlockManager
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence("r", 0, list(tokens), len(tokens), SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Prefix lookup + allocation for the whole sequence, then mark it computed and cache its
    blocks."""
    hits = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(hits) * BS, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hits


def test_allocation_takes_blocks_in_order_and_wastes_at_most_one_partial_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(9)))  # 9 tokens -> 3 blocks, the last holding 1 token
    assert bm.allocate(seq, 9)
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    seq.num_computed_tokens = 9
    seq.token_ids.extend([100, 101, 102])  # 12 tokens: still 3 blocks
    assert bm.allocate(seq, 3) and seq.block_table == [0, 1, 2]
    seq.token_ids.append(103)
    seq.num_computed_tokens = 12
    assert bm.allocate(seq, 1) and seq.block_table == [0, 1, 2, 3]
    bm.check_integrity([seq])


def test_allocation_fails_without_side_effects_when_blocks_run_out() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(list(range(9)))
    assert not bm.allocate(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    bm.check_integrity([seq])


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])  # shares the first two full blocks
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    bm.record_prefix_query(b.num_tokens, 8)
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (10, 8)
    bm.check_integrity([a, b])


def test_last_token_is_never_a_cache_hit() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_seq(list(range(8)))  # exactly two full blocks
    admit(bm, a)
    b = make_seq(list(range(8)))  # the same 8 tokens: only the first block may hit
    assert bm.find_cached_prefix(b) == [a.block_table[0]]


def test_hit_is_confirmed_by_stored_tokens_not_hash_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpilot.engine.kv_cache.prefix_cache as module

    monkeypatch.setattr(module, "hash_block", lambda *key: 7)  # every block collides
    bm = BlockManager(num_blocks=10, block_size=BS)
    admit(bm, make_seq([1, 2, 3, 4, 5]))
    assert bm.find_cached_prefix(make_seq([9, 9, 9, 9, 5])) == []


def test_cache_salt_isolates_tenants() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    admit(bm, make_seq(tokens, salt="tenant-a"))
    assert bm.find_cached_prefix(make_seq(tokens, salt="tenant-b")) == []
    assert bm.find_cached_prefix(make_seq(tokens)) == []
    assert bm.find_cached_prefix(make_seq(tokens, salt="tenant-a")) == [0, 1]


def test_free_keeps_cached_blocks_until_reused_with_lru_eviction_order() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks 0,1 full (cached), 2 partial
    admit(bm, a)
    bm.free(a)
    # Unhashed block 2 goes to the front; hashed blocks follow, tail (1) before head (0).
    assert list(bm.free_queue) == [2, 3, 4, 5, 1, 0]
    assert bm.usage == 0.0
    # Still cached: a new request hits them.
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 50])
    assert bm.find_cached_prefix(b) == [0, 1]
    # Now take every free block: the cached ones are evicted last, tail first.
    c = make_seq(list(range(100, 124)))  # 6 blocks
    assert bm.allocate(c, 24)
    assert c.block_table == [2, 3, 4, 5, 1, 0]
    assert bm.cached == {}
    assert bm.find_cached_prefix(b) == []
    bm.check_integrity([c])


def test_taking_a_cached_free_block_removes_it_from_the_free_queue() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 6])
    assert admit(bm, b) == [0]
    assert 0 not in bm.free_queue and bm.blocks[0].ref_count == 1
    bm.check_integrity([b])


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    admit(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    assert bm.cached == {}


def test_with_prefix_caching_off_nothing_is_published_counted_or_reported() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    admit(bm, make_seq(tokens))
    bm.record_prefix_query(9, 0)
    assert bm.find_cached_prefix(make_seq(tokens)) == []
    assert bm.cached == {} and bm.drain_kv_events() is None
    assert bm.num_queried_tokens == bm.num_hit_tokens == 0
