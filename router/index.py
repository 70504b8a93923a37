"""One replica's prefix-cache contents as the router knows them: the set of block hashes its
engine reported, bounded in size, and the longest run of a request's hash chain it holds.

The engine's own bookkeeping is the truth; this is a mirror fed by its block events (snapshot,
then deltas). Cleared whenever the stream breaks, so it is never stale: an unknown replica
merely looks cold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence


class BlockIndex:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.hashes: set[int] = set()
        # Set when the engine reported more than max_blocks: later stores are dropped, so the
        # index underestimates what the replica holds (never overestimates).
        self.is_truncated = False

    def __len__(self) -> int:
        return len(self.hashes)

    def reset(self, hashes: Iterable[int] = ()) -> None:
        self.hashes = set()
        self.is_truncated = False
        self.store(hashes)

    def store(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            if len(self.hashes) >= self.max_blocks:
                self.is_truncated = True
                return
            self.hashes.add(block_hash)

    def remove(self, hashes: Iterable[int]) -> None:
        self.hashes.difference_update(hashes)

    def digest(self) -> str:
        """A short fingerprint of the whole set (routers and tests compare indexes by it)."""
        digest = hashlib.blake2b(digest_size=8)
        for block_hash in sorted(self.hashes):
            digest.update(block_hash.to_bytes(8, "little"))
        return digest.hexdigest()

    def matched_blocks(self, chain: Sequence[int]) -> int:
        """How many leading blocks of the chain this replica holds (the engine reuses only a
        prefix: a held block after a missing one is no use)."""
        held = self.hashes
        for count, block_hash in enumerate(chain):
            if block_hash not in held:
                return count
        return len(chain)
