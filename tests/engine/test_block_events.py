"""Block hashes outside the engine agree with what its block manager stores, and the cache-change
events let a mirror hold exactly the block manager's cached set; the API side's event hub serves
a snapshot, then numbered deltas, and a snapshot again to a subscriber that fell behind."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time

import pytest

from kvpilot.contract.block_hash import HASH_SCHEME, chain_block_hashes, hash_block
from kvpilot.contract.kv_events import KvDelta, KvHeartbeat, KvSnapshot, KvUpdate, Load
from kvpilot.engine.kv_cache.block_manager import BlockManager
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.server.kv_events import KvEventHub

BS = 4


def make_seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence("r", 0, list(tokens), len(tokens), SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    hits = bm.find_cached_prefix(seq)
    if not bm.allocate(seq, seq.num_tokens - len(hits) * BS, hits):
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return True


def apply(mirror: set[int], delta: KvDelta | None) -> None:
    if delta is not None:
        assert not set(delta.stored) & set(delta.removed)
        mirror.difference_update(delta.removed)
        mirror.update(delta.stored)


def test_chain_matches_block_manager_and_events_mirror_its_cache_through_eviction() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=24, block_size=BS)
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    mirror: set[int] = set()
    live: list[Sequence] = []
    num_evictions = 0
    for step in range(300):
        if live and (rng.random() < 0.45 or len(live) > 4):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(12))]
            seq = make_seq(tokens, salt=rng.choice([None, "tenant-a", "tenant-b"]))
            before = set(bm.cached)
            if admit(bm, seq):
                live.append(seq)
                num_evictions += len(before - set(bm.cached))
                assert seq.block_hashes == chain_block_hashes(tokens, BS, seq.cache_salt)
        if step == 200:
            for seq in live:
                bm.free(seq)
            live.clear()
            bm.reset_prefix_cache()
            assert bm.cached == {}
        if rng.random() < 0.3:  # the core drains once per step, not once per change
            apply(mirror, bm.drain_kv_events())
            assert mirror == set(bm.cached)
    apply(mirror, bm.drain_kv_events())
    assert mirror == set(bm.cached)
    assert bm.drain_kv_events() is None
    assert num_evictions > 10, "the pool was meant to be small enough to evict"


def test_hash_is_chained_salted_and_extends_a_known_prefix() -> None:
    tokens = list(range(10))
    chain = chain_block_hashes(tokens, BS, None)
    assert len(chain) == 2  # the partial third block is not hashed
    assert chain[0] == hash_block(None, tokens[:4], None)
    assert chain[1] == hash_block(chain[0], tokens[4:8], None)
    assert chain_block_hashes(tokens, BS, "a") != chain
    assert chain_block_hashes(tokens, BS, "") != chain  # an empty salt is a salt
    assert chain_block_hashes([*tokens, 1, 2], BS, None, known=chain[:1])[:2] == chain
    # The same block under another parent is another block.
    assert chain_block_hashes(tokens[4:8], BS, None)[0] != chain[1]
    with pytest.raises(ValueError, match="block_size"):
        chain_block_hashes(tokens, 0, None)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("salt", [None, "", "tenant-é"])
def test_a_chain_is_hash_block_over_each_block_in_turn(block_size: int, salt: str | None) -> None:
    rng = random.Random(block_size)
    tokens = [rng.randrange(1 << 17) for _ in range(7 * block_size + block_size // 2)]
    expected: list[int] = []
    for start in range(0, 7 * block_size, block_size):
        parent = expected[-1] if expected else None
        expected.append(hash_block(parent, tokens[start : start + block_size], salt))
    assert chain_block_hashes(tokens, block_size, salt) == expected
    assert chain_block_hashes(tokens, block_size, salt, known=expected[:3]) == expected


def test_the_hash_layout_is_the_one_hash_scheme_names() -> None:
    # Values as first published: a change here must come with a new HASH_SCHEME. v2 added the
    # adapter and kept v1's values for blocks without one.
    assert HASH_SCHEME == "blake2b64-v2"
    assert chain_block_hashes(list(range(10)), 4, None) == [
        13143853188306262454, 6922413457484497104,
    ]  # fmt: skip
    assert chain_block_hashes(list(range(10)), 4, "t") == [
        8982724407335810944, 15387704814386664274,
    ]  # fmt: skip
    assert chain_block_hashes(list(range(10)), 4, None, lora_name="team-a") == [
        18257303405704249425, 9075375867153579941,
    ]  # fmt: skip
    assert chain_block_hashes(list(range(10)), 4, "t", lora_name="team-a") == [
        8835414799293053923, 14384768801043005445,
    ]  # fmt: skip


def test_an_adapter_never_shares_a_hash_with_the_base_another_adapter_or_a_salt() -> None:
    tokens = list(range(8))
    chains = {
        (salt, lora): tuple(chain_block_hashes(tokens, 4, salt, lora_name=lora))
        for salt in (None, "", "a", "\x02\x01\x00a")
        for lora in (None, "a", "b", "a\x01")
    }
    assert len(set(chains.values())) == len(chains)


def test_hash_is_the_same_in_every_process() -> None:
    code = (
        "from kvpilot.contract.block_hash import chain_block_hashes as c;"
        "print(c(list(range(32)), 16, 'tenant'))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {f"{chain_block_hashes(list(range(32)), 16, 'tenant')}\n"}


async def test_hub_sends_snapshot_then_numbered_deltas_and_heartbeats() -> None:
    hub = KvEventHub("m", BS)
    hub.publish(KvDelta([1, 2, 3], []), Load(0, 1, 0.1))
    stream = hub.subscribe(heartbeat_s=0.05)
    first = await anext(stream)
    assert first == KvSnapshot(1, "m", BS, HASH_SCHEME, [1, 2, 3], Load(0, 1, 0.1))
    hub.publish(None, Load(2, 1, 0.2))  # load only: no delta, no new seq
    hub.publish(KvDelta([4], [1]), Load(0, 2, 0.3))
    hub.publish(KvDelta([], [2]), Load(0, 2, 0.3))
    assert await anext(stream) == KvUpdate(2, [4], [1], Load(0, 2, 0.3))
    assert await anext(stream) == KvUpdate(3, [], [2], Load(0, 2, 0.3))
    assert await anext(stream) == KvHeartbeat(3, Load(0, 2, 0.3))
    await stream.aclose()
    assert hub.snapshot().hashes == [3, 4]


async def test_hub_resends_a_snapshot_to_a_subscriber_past_its_log() -> None:
    hub = KvEventHub("m", BS, log_length=2)
    stream = hub.subscribe(heartbeat_s=5)
    assert (await anext(stream)).seq == 0
    for h in range(5):  # more deltas than the log keeps, before the subscriber reads again
        hub.publish(KvDelta([h], []), Load())
    resent = await asyncio.wait_for(anext(stream), 5)
    assert isinstance(resent, KvSnapshot)
    assert (resent.seq, resent.hashes) == (5, [0, 1, 2, 3, 4])
    await stream.aclose()


async def test_a_heartbeat_never_claims_a_delta_the_stream_has_not_sent() -> None:
    # A delta published just as the subscriber's heartbeat timer runs out (as the output thread
    # may): the heartbeat must carry the seq this stream is at, not the hub's newer one. A router
    # reading seq n+1 before delta n+1 drops that replica's whole index as out of sync
    # (bench/router_chat.py's router log showed it: "expected seq 33, got 33").
    hub = KvEventHub("m", BS)
    stream = hub.subscribe(heartbeat_s=0.02)
    assert (await anext(stream)).seq == 0
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the subscriber now waits, its heartbeat timer running
    # Due right after the heartbeat timer: both run in one turn of the loop, the timer first.
    asyncio.get_running_loop().call_later(0.021, hub.publish, KvDelta([7], []), Load())
    time.sleep(0.05)  # the loop is busy past both
    messages = [await asyncio.wait_for(pending, 5)]
    if isinstance(messages[0], KvHeartbeat):
        messages.append(await asyncio.wait_for(anext(stream), 5))
    await stream.aclose()
    assert messages[-1] == KvUpdate(1, [7], [], Load())
    assert [m.seq for m in messages[:-1]] in ([], [0])
