"""A shared prefix in the block hash chain: the blocks a request marks as shared with every tenant
hash as if it had no salt, the rest with its salt; a chain that marks none is unchanged."""

from __future__ import annotations

import pytest

from kvpilot.contract.block_hash import chain_block_hashes, hash_block
from kvpilot.contract.tenancy import unsalted_blocks

TOKENS = list(range(20))  # five blocks of 4


def test_without_a_shared_prefix_the_chain_is_the_published_one() -> None:
    # The values test_block_events pins for v2: unsalted_blocks=0 must not move them.
    assert chain_block_hashes(list(range(10)), 4, "t", unsalted_blocks=0) == [
        8982724407335810944, 15387704814386664274,
    ]  # fmt: skip
    assert chain_block_hashes(list(range(10)), 4, None, unsalted_blocks=2) == [
        13143853188306262454, 6922413457484497104,
    ]  # fmt: skip


def test_the_shared_blocks_hash_without_the_salt_and_the_rest_with_it() -> None:
    bare = chain_block_hashes(TOKENS, 4, None)
    chain_a = chain_block_hashes(TOKENS, 4, "tenant:a", unsalted_blocks=2)
    chain_b = chain_block_hashes(TOKENS, 4, "tenant:b", unsalted_blocks=2)
    assert chain_a[:2] == chain_b[:2] == bare[:2]
    assert len({chain_a[i] for i in range(2, 5)} | {chain_b[i] for i in range(2, 5)}) == 6
    assert set(chain_a[2:]).isdisjoint(bare)
    # Each hash is hash_block's with the salt that block takes.
    parent = chain_a[1]
    assert chain_a[2] == hash_block(parent, TOKENS[8:12], "tenant:a")
    assert chain_a[1] == hash_block(chain_a[0], TOKENS[4:8], None)
    # Extending a known chain keeps the rule.
    assert chain_block_hashes(TOKENS, 4, "tenant:a", known=chain_a[:3], unsalted_blocks=2) == (
        chain_a
    )


def test_the_value_of_a_shared_chain_is_pinned() -> None:
    # The router computes the same chains: a change here must come with a new HASH_SCHEME.
    assert chain_block_hashes(list(range(10)), 4, "t", unsalted_blocks=1) == [
        13143853188306262454, 14594989753287483204,
    ]  # fmt: skip
    assert chain_block_hashes(list(range(10)), 4, "t", unsalted_blocks=1)[1] == hash_block(
        13143853188306262454, [4, 5, 6, 7], "t"
    )


def test_only_whole_blocks_of_the_shared_prefix_go_unsalted() -> None:
    assert unsalted_blocks(9, 4) == 2 and unsalted_blocks(3, 4) == 0
    shared = chain_block_hashes(TOKENS, 4, "s", unsalted_blocks=unsalted_blocks(7, 4))
    assert shared[0] == chain_block_hashes(TOKENS, 4, None)[0]
    assert shared[1:] == chain_block_hashes(TOKENS, 4, "s", unsalted_blocks=1)[1:]
    assert shared[1] != chain_block_hashes(TOKENS, 4, None)[1]


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="unsalted_blocks must be >= 0"):
        chain_block_hashes(TOKENS, 4, "s", unsalted_blocks=-1)
