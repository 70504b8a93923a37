"""The draft model's KV cache: a paged pool of its own (engine/kv_cache/pool.py), its blocks handed
to sequences by a free list, and per sequence how many of its tokens the draft holds.

Per sequence, not shared through the prefix cache: the draft's KV of a token depends only on the
tokens up to it, so what it holds stays right for as long as the sequence's token ids do, and a
prefix-cache hit of the target (or a preemption, which keeps the token ids) costs the draft no
more than computing the prompt it never saw. Rejected proposals roll back by count: the draft
holds the proposals it fed itself as far as they match the tokens the sequence then took
(`DraftState.rollback`); the slots past that are overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.sequence import Sequence


@dataclass
class DraftState:
    """What the draft holds of one sequence."""

    blocks: list[int] = field(default_factory=list)
    # The first num_computed of the sequence's token ids have their KV in the draft's blocks.
    num_computed: int = 0
    # The proposals last fed to the draft, at positions base, base + 1, ... (KV written, but
    # right only where the sequence took the same tokens).
    base: int = 0
    fed: list[int] = field(default_factory=list)

    def rollback(self, token_ids: list[int]) -> None:
        """Keeps the fed proposals' KV up to the first one the sequence did not take."""
        if not self.fed:
            return
        matched = 0
        taken = token_ids[self.base : self.base + len(self.fed)]
        while matched < len(taken) and taken[matched] == self.fed[matched]:
            matched += 1
        self.num_computed = self.base + matched
        self.fed = []


class DraftBlocks:
    """The draft pool's blocks and which sequence holds which (by seq_id)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.states: dict[int, DraftState] = {}

    def state(self, seq: Sequence) -> DraftState:
        """The sequence's state (a new, empty one the first time)."""
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = DraftState()
        return state

    def reserve(self, state: DraftState, num_tokens: int) -> bool:
        """Blocks for the sequence's first num_tokens tokens; False (nothing taken) where the
        pool has too few free."""
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        if needed <= 0:
            return True
        if needed > len(self.free):
            return False
        state.blocks.extend(self.free.pop() for _ in range(needed))
        return True

    def slot(self, state: DraftState, position: int) -> int:
        return state.blocks[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def drop(self, seq_id: int) -> None:
        """The sequence's blocks go back to the pool."""
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.free.extend(reversed(state.blocks))

    def keep_only(self, seq_ids: set[int]) -> None:
        for seq_id in [s for s in self.states if s not in seq_ids]:
            self.drop(seq_id)

    @property
    def num_free(self) -> int:
        return len(self.free)
