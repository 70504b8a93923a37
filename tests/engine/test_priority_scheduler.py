"""The priority scheduling policy on plain Python state: queue order, the KV victim, a full batch
giving a place up to a better request, and equal priorities scheduling exactly as fcfs."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv_cache.block_manager import BlockManager
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler, SchedulerOutput
from kvpilot.engine.sequence import Sequence, SequenceStatus

BS = 4


def make_seq(n: int, rid: str, priority: int = 0, start: int = 0) -> Sequence:
    tokens = list(range(start, start + n))
    return Sequence(rid, 0, tokens, n, SamplingParams(), priority=priority)


def scheduler(
    num_blocks: int = 64,
    *,
    policy: str = "priority",
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    prefix_caching: bool = False,
    adapters: Slots | None = None,
    isolate: bool = False,
    guard_window_s: float = 0.0,
    guard_step_seqs: int = 4,
    guard_step_tokens: int = 4,
    clock: Clock | None = None,
) -> Scheduler:
    """Without isolation and the guard unless asked: most tests here are about order and
    preemption, which they leave alone; test_priority_steps.py is about them."""
    bm = BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        policy=policy,
        isolate_prefills=isolate,
        guard_window_s=guard_window_s,
        guard_step_seqs=guard_step_seqs,
        guard_step_tokens=guard_step_tokens,
    )
    return Scheduler(config, bm, adapters, clock or Clock())


def run_step(sched: Scheduler, sampled_token: int = 7) -> SchedulerOutput:
    """What the engine does after the model ran: advance computed counts, append sampled tokens."""
    out = sched.schedule()
    for item in out.scheduled:
        will_sample = item.will_sample
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.cache_full_blocks(item.seq)
        if will_sample:
            item.seq.token_ids.append(sampled_token)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def names(seqs: object) -> list[str]:
    return [s.request_id for s in seqs]  # type: ignore[attr-defined]


class Clock:
    """The scheduler's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Slots:
    """AdapterSlots over a fixed number of slots, for adapters marked readable."""

    def __init__(self, num_slots: int) -> None:
        self.readable: set[str] = set()
        self.resident: list[str | None] = [None] * num_slots

    def slot_for(self, name: str, busy: set[str]) -> int | None:
        if name not in self.readable:
            return None
        if name in self.resident:
            return self.resident.index(name)
        for slot, held in enumerate(self.resident):
            if held is None or held not in busy:
                self.resident[slot] = name
                return slot
        return None


def test_the_queue_is_ordered_by_priority_then_arrival() -> None:
    sched = scheduler(max_num_seqs=2)
    for rid, priority in [("a", 1), ("b", 0), ("c", 1), ("d", -1), ("e", 0)]:
        sched.add(make_seq(5, rid, priority))
    assert names(sched.waiting) == ["d", "b", "e", "a", "c"]
    assert plan(run_step(sched)) == [("d", 5), ("b", 5)]
    assert names(sched.waiting) == ["e", "a", "c"]


def test_fcfs_keeps_arrival_order_whatever_the_priority() -> None:
    sched = scheduler(policy="fcfs", max_num_seqs=2)
    for rid, priority in [("a", 1), ("b", 0), ("c", -1)]:
        sched.add(make_seq(5, rid, priority))
    assert plan(run_step(sched)) == [("a", 5), ("b", 5)]
    sched.add(make_seq(5, "d", -5))
    out = run_step(sched)
    assert out.preempted == [] and plan(out) == [("a", 1), ("b", 1)]  # no displacement


def test_under_kv_pressure_the_worst_priority_is_preempted_not_the_newest() -> None:
    # 4 blocks of 4 tokens; two sequences of 7 tokens take 2 blocks each, until position 8.
    sched = scheduler(num_blocks=4)
    low, high = make_seq(7, "low", priority=1), make_seq(7, "high", priority=0, start=50)
    sched.add(low)
    assert plan(run_step(sched)) == [("low", 7)]
    sched.add(high)
    assert plan(run_step(sched)) == [("low", 1), ("high", 7)]
    out = run_step(sched)  # low's position 8 needs a third block: low gives its own up
    assert names(out.preempted) == ["low"] and plan(out) == [("high", 1)]
    assert low.status is SequenceStatus.WAITING and low.block_table == []
    sched.block_manager.check_integrity([low, high])


def test_fcfs_preempts_the_newest_in_the_same_case() -> None:
    sched = scheduler(num_blocks=4, policy="fcfs")
    low, high = make_seq(7, "low", priority=1), make_seq(7, "high", priority=0, start=50)
    sched.add(low)
    run_step(sched)
    sched.add(high)
    run_step(sched)
    out = run_step(sched)
    assert names(out.preempted) == ["high"] and plan(out) == [("low", 1)]


def test_among_equal_priorities_the_last_admitted_is_the_victim() -> None:
    sched = scheduler(num_blocks=6)
    seqs = [make_seq(7, "first", 1), make_seq(7, "second", 1, 50), make_seq(7, "best", 0, 90)]
    for seq in seqs:
        sched.add(seq)
    assert plan(run_step(sched)) == [("best", 7), ("first", 7), ("second", 7)]
    run_step(sched)
    out = run_step(sched)  # each needs a third block, none free: best's takes second's
    assert names(out.preempted) == ["second"] and plan(out) == [("best", 1), ("first", 1)]


def test_a_request_never_preempts_a_better_one_for_its_own_blocks() -> None:
    # The worst running sequence is the one that needs a block: it preempts itself.
    sched = scheduler(num_blocks=4)
    high, low = make_seq(8, "high", -1), make_seq(7, "low", 1, start=50)
    sched.add(high)
    sched.add(low)
    assert plan(run_step(sched)) == [("high", 8), ("low", 7)]  # high: 9 tokens, a third block
    out = run_step(sched)
    assert names(out.preempted) == ["low"] and plan(out) == [("high", 1)]
    assert high.status is SequenceStatus.RUNNING


def test_a_preempted_request_returns_to_its_place_by_priority() -> None:
    sched = scheduler(num_blocks=4, max_num_seqs=2)
    low, mid = make_seq(7, "low", 2), make_seq(7, "mid", 1, start=50)
    sched.add(low)
    sched.add(mid)
    run_step(sched)
    run_step(sched)
    for rid, priority in [("later-low", 2), ("better", 0), ("worst", 3)]:
        sched.add(make_seq(3, rid, priority, start=100))
    out = run_step(sched)  # KV pressure: low goes; no admission in a step that preempted
    assert names(out.preempted) == ["low"] and plan(out) == [("mid", 1)]
    # Back before the others of its rank, after every better one.
    assert names(sched.waiting) == ["better", "low", "later-low", "worst"]


def test_a_full_batch_gives_the_worst_place_to_a_strictly_better_request() -> None:
    sched = scheduler(max_num_seqs=2)
    a, b = make_seq(5, "a", 1), make_seq(5, "b", 1, start=20)
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [("a", 5), ("b", 5)]
    same = make_seq(5, "same", 1, start=40)
    sched.add(same)
    out = run_step(sched)  # equal priority: it waits for a place
    assert out.preempted == [] and plan(out) == [("a", 1), ("b", 1)]
    high = make_seq(5, "high", 0, start=60)
    sched.add(high)
    assert names(sched.waiting) == ["high", "same"]
    out = run_step(sched)
    # b (the last admitted of the worst) gives its place up, and its token budget, to high.
    assert names(out.preempted) == ["b"] and plan(out) == [("a", 1), ("high", 5)]
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert names(sched.waiting) == ["b", "same"]  # b before same: preempted first in its rank
    assert sched.num_preemptions == 1
    sched.block_manager.check_integrity([a, b, same, high])
    # Nothing better waits now: the batch stays as it is.
    out = run_step(sched)
    assert out.preempted == [] and plan(out) == [("a", 1), ("high", 1)]


def test_a_request_ending_with_its_token_in_flight_is_not_displaced() -> None:
    sched = scheduler(max_num_seqs=1)
    low = make_seq(5, "low", 1)
    sched.add(low)
    run_step(sched)
    low.reached_length = True  # async scheduling: its last token is on the device
    sched.add(make_seq(5, "high", 0, start=20))
    out = run_step(sched)
    assert out.preempted == [] and plan(out) == []


def test_a_better_request_takes_kv_blocks_from_worse_running_ones() -> None:
    # 5 blocks: two low requests hold 2 each; high needs 2 for its 6 tokens, and 1 is free.
    sched = scheduler(num_blocks=5)
    low0, low1 = make_seq(7, "low0", 1), make_seq(7, "low1", 1, start=20)
    sched.add(low0)
    sched.add(low1)
    run_step(sched)
    high = make_seq(6, "high", 0, start=80)
    sched.add(high)
    out = run_step(sched)
    assert names(out.preempted) == ["low1"] and plan(out) == [("low0", 1), ("high", 6)]
    sched.block_manager.check_integrity([low0, low1, high])
    # An equal one finds no blocks and waits: never a preemption for it.
    sched.add(make_seq(6, "peer", 1, start=90))
    out = run_step(sched)
    assert out.preempted == [] and plan(out) == [("low0", 1), ("high", 1)]
    assert names(sched.waiting) == ["low1", "peer"]


def test_a_request_passed_over_for_its_adapter_keeps_its_place() -> None:
    slots = Slots(num_slots=1)
    sched = scheduler(max_num_seqs=2, adapters=slots)
    low = make_seq(5, "low", 1)
    sched.add(low)
    run_step(sched)
    held = make_seq(5, "held", -1, start=20)
    held.lora_name = "sql"  # not readable yet
    sched.add(held)
    sched.add(make_seq(5, "mid", 0, start=40))
    out = run_step(sched)
    assert out.preempted == [] and plan(out) == [("low", 1), ("mid", 5)]
    assert names(sched.waiting) == ["held"]
    slots.readable.add("sql")
    out = run_step(sched)  # its adapter ready: it takes the place of the worst running one
    assert names(out.preempted) == ["low"] and plan(out) == [("mid", 1), ("held", 5)]
    assert held.lora_slot == 0


def test_a_displaced_chunked_prefill_resumes_from_its_cached_blocks() -> None:
    sched = scheduler(max_num_seqs=1, max_num_batched_tokens=8, prefix_caching=True)
    low = make_seq(20, "low", 1)
    sched.add(low)
    assert plan(run_step(sched)) == [("low", 8)]  # first chunk: two full blocks, published
    high = make_seq(10, "high", 0, start=100)
    sched.add(high)
    out = run_step(sched)
    assert names(out.preempted) == ["low"] and plan(out) == [("high", 8)]
    assert plan(run_step(sched)) == [("high", 2)]  # high's last chunk samples its first token
    sched.finish(high)
    # low restarts from its cached prefix: 8 of its 20 tokens come from the cache.
    assert plan(run_step(sched)) == [("low", 8)]
    assert low.num_computed_tokens == 16
    sched.block_manager.check_integrity([low, high])


def random_workload(seed: int) -> list[tuple[int, str, int, int]]:
    """(step it arrives at, id, prompt length, tokens to generate), some sharing a prefix."""
    rng = random.Random(seed)
    return [
        (rng.randrange(12), f"r{i}", rng.randrange(2, 30), rng.randrange(1, 8)) for i in range(16)
    ]


def schedule_trace(policy: str, priority: int, seed: int) -> list[object]:
    """Every step's plan, preemptions and queue for one workload, run to the end."""
    sched = scheduler(  # isolation and the guard on: among equal ranks they change nothing
        num_blocks=14,
        policy=policy,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        prefix_caching=True,
        isolate=True,
        guard_window_s=2.0,
        guard_step_seqs=1,
        guard_step_tokens=1,
    )
    workload = random_workload(seed)
    targets: dict[str, int] = {}
    trace: list[object] = []
    for step in range(400):
        for arrival, rid, length, num_out in workload:
            if arrival == step:
                sched.add(make_seq(length, rid, priority, start=(length % 3) * 5))
                targets[rid] = num_out
        out = run_step(sched)
        trace.append((plan(out), names(out.preempted), names(sched.waiting)))
        for item in out.scheduled:
            if item.seq.num_output_tokens >= targets[item.seq.request_id]:
                sched.finish(item.seq)
        if step > 12 and not sched.has_unfinished():
            return trace
    raise AssertionError("the workload did not finish")


@pytest.mark.parametrize("seed", range(6))
def test_equal_priorities_schedule_exactly_as_fcfs(seed: int) -> None:
    fcfs = schedule_trace("fcfs", 0, seed)
    # The pool is small enough to preempt while others wait.
    assert any(preempted and waiting[len(preempted) :] for _, preempted, waiting in fcfs)
    assert schedule_trace("priority", 0, seed) == fcfs
    assert schedule_trace("priority", 3, seed) == fcfs


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority"):
        SchedulerConfig(policy="lifo")
