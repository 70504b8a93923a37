"""The engine's prefix cache under salts with a shared prefix: two tenants' requests share
exactly the blocks inside kvpilot_shared_prefix_tokens, hashed as the contract's chain is."""

from __future__ import annotations

from kvpilot.contract.block_hash import chain_block_hashes
from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv_cache.block_manager import BlockManager
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.sequence import Sequence

BS = 4
PROMPT = list(range(100, 123))  # five full blocks and 3 tokens


def admit(sched: Scheduler, salt: str | None, shared: int, rid: str) -> Sequence:
    seq = Sequence(
        rid, 0, list(PROMPT), len(PROMPT), SamplingParams(), cache_salt=salt,
        shared_prefix_tokens=shared,
    )  # fmt: skip
    sched.add(seq)
    out = sched.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.cache_full_blocks(item.seq)
    return seq


def fresh() -> Scheduler:
    bm = BlockManager(num_blocks=64, block_size=BS, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256), bm)


def test_two_tenants_share_exactly_the_blocks_of_the_shared_prefix() -> None:
    sched = fresh()
    a = admit(sched, "tenant:a", 10, "a")  # 10 tokens: 2 whole blocks shared
    b = admit(sched, "tenant:b", 10, "b")
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 2 * BS)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert a.block_hashes == chain_block_hashes(PROMPT, BS, "tenant:a", unsalted_blocks=2)
    assert set(sched.block_manager.cached) >= set(a.block_hashes) | set(b.block_hashes)
    # The same tenant again reuses its own chain past the shared part (never the last token).
    again = admit(sched, "tenant:a", 10, "a2")
    assert again.num_cached_tokens == 5 * BS
    # A request without a salt shares the shared blocks: they are the unsalted ones.
    bare = admit(sched, None, 0, "bare")
    assert bare.num_cached_tokens == 2 * BS
    sched.block_manager.check_integrity([a, b, again, bare])


def test_without_a_shared_prefix_salted_requests_share_nothing() -> None:
    sched = fresh()
    admit(sched, "tenant:a", 0, "a")
    assert admit(sched, "tenant:b", 0, "b").num_cached_tokens == 0
    assert admit(sched, None, 0, "bare").num_cached_tokens == 0
