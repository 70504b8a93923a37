"""What bounds a better request's wait under the priority policy (engine/scheduler.py): a better
prefill runs in a step without worse work (isolation), and while a better rank was seen recently
the worse ranks share a few tokens of each step (the guard), resumed preemptions included. Worse
ranks still progress beside better decodes; fcfs and equal ranks are untouched."""

from __future__ import annotations

import pytest

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.scheduler import Scheduler
from tests.engine.test_priority_scheduler import (
    Clock,
    Slots,
    make_seq,
    names,
    plan,
    run_step,
    scheduler,
)

GUARD = 3


def guarded(
    clock: Clock, *, policy: str = "priority", max_num_seqs: int = 8, adapters: Slots | None = None
) -> Scheduler:
    return scheduler(
        policy=policy,
        max_num_seqs=max_num_seqs,
        isolate=True,
        guard_window_s=2.0,
        guard_step_tokens=GUARD,
        clock=clock,
        adapters=adapters,
    )


def decoding_lows(sched: Scheduler, count: int, priority: int = 1) -> None:
    """`count` worse requests past their prefill, decoding."""
    for i in range(count):
        sched.add(make_seq(5, f"low{i}", priority, start=10 * i))
    run_step(sched)
    assert all(s.is_decoding for s in sched.running)


def test_a_better_prefill_runs_in_a_step_without_worse_work() -> None:
    clock = Clock()
    sched = guarded(clock)
    decoding_lows(sched, 5)
    clock.now += 10  # the lows alone for long: no guard
    assert plan(run_step(sched)) == [(f"low{i}", 1) for i in range(5)]
    sched.add(make_seq(20, "high", -1, start=200))
    out = run_step(sched)
    assert plan(out) == [("high", 20)] and out.preempted == []
    assert all(s.status.name == "RUNNING" for s in sched.running)  # skipped, not preempted
    # A second better prompt while the first decodes: the step holds the better ranks only.
    sched.add(make_seq(6, "high2", -1, start=300))
    assert plan(run_step(sched)) == [("high", 1), ("high2", 6)]


def test_a_better_chunked_prefill_keeps_worse_work_out_of_each_chunk() -> None:
    clock = Clock()
    sched = scheduler(max_num_batched_tokens=10, isolate=True, clock=clock)  # no guard
    decoding_lows(sched, 2)
    sched.add(make_seq(24, "high", 0, start=200))
    assert plan(run_step(sched)) == [("high", 10)]
    assert plan(run_step(sched)) == [("high", 10)]
    assert plan(run_step(sched)) == [("high", 4)]  # its first token
    # Only decoding now: the worse ones join its steps (no guard here: all of them).
    assert plan(run_step(sched)) == [("low0", 1), ("low1", 1), ("high", 1)]


def test_while_a_better_rank_decodes_worse_ranks_share_the_guard_tokens() -> None:
    clock = Clock()
    sched = guarded(clock)
    decoding_lows(sched, 5)
    sched.add(make_seq(6, "high", 0, start=200))
    run_step(sched)  # high's prefill, alone
    # Worse ranks progress beside the better decodes, GUARD tokens of them a step.
    for _ in range(3):
        out = run_step(sched)
        assert plan(out) == [("low0", 1), ("low1", 1), ("low2", 1), ("high", 1)]
    # A worse prompt waiting is admitted in chunks of what the guard leaves.
    sched.finish(sched.running[0])
    sched.finish(sched.running[0])
    sched.add(make_seq(20, "late", 2, start=400))
    assert plan(run_step(sched)) == [("low2", 1), ("low3", 1), ("low4", 1), ("high", 1)]
    sched.finish(sched.running[0])
    sched.finish(sched.running[0])
    assert plan(run_step(sched)) == [("low4", 1), ("high", 1), ("late", 2)]
    assert plan(run_step(sched)) == [("low4", 1), ("high", 1), ("late", 2)]


def test_the_guard_ends_a_window_after_the_better_rank_was_last_seen() -> None:
    clock = Clock()
    sched = guarded(clock)
    decoding_lows(sched, 5)
    high = make_seq(6, "high", 0, start=200)
    sched.add(high)
    run_step(sched)
    sched.finish(high)
    clock.now += 1.9
    assert len(run_step(sched).scheduled) == GUARD
    clock.now += 2.1  # 2.1 s after the last step that saw it
    assert len(run_step(sched).scheduled) == 5


def test_a_declared_better_rank_guards_before_its_first_request() -> None:
    clock = Clock()
    for declared, first_step in ((None, 4 * 5), (-1, GUARD), (1, 4 * 5)):
        sched = guarded(clock, policy="priority")
        for i in range(4):  # a burst of worse prompts, no better request seen yet
            seq = make_seq(5, f"low{i}", 1, start=10 * i)
            seq.guard_priority = declared  # 1: not better than its own rank, ignored
            sched.add(seq)
        assert run_step(sched).num_tokens == first_step, declared
    # Under fcfs the declaration changes nothing.
    sched = guarded(clock, policy="fcfs")
    for i in range(4):
        seq = make_seq(5, f"low{i}", 1, start=10 * i)
        seq.guard_priority = -1
        sched.add(seq)
    assert run_step(sched).num_tokens == 4 * 5
    # The declaration lasts while its sequences are here, then the window.
    sched = guarded(clock)
    seq = make_seq(5, "low", 1)
    seq.guard_priority = -1
    sched.add(seq)
    sched.add(make_seq(5, "plain", 1, start=50))
    assert plan(run_step(sched)) == [("low", GUARD)]
    sched.finish(seq)
    clock.now += 2.1
    assert plan(run_step(sched)) == [("plain", 5)]


def test_a_preempted_worse_request_resumes_within_the_guard() -> None:
    clock = Clock()
    sched = guarded(clock, max_num_seqs=1)
    low = make_seq(20, "low", 1)
    sched.add(low)
    assert plan(run_step(sched)) == [("low", 20)]  # nothing better seen yet: one step
    sched.add(make_seq(6, "high", 0, start=200))
    out = run_step(sched)  # the full batch: the better one takes low's place
    assert names(out.preempted) == ["low"] and plan(out) == [("high", 6)]
    sched.finish(sched.running[0])
    # Its recompute (21 tokens now) comes back GUARD tokens a step while the window lasts.
    assert plan(run_step(sched)) == [("low", GUARD)]
    assert plan(run_step(sched)) == [("low", GUARD)]
    clock.now += 3
    assert plan(run_step(sched)) == [("low", 21 - 2 * GUARD)]


def test_a_better_request_held_back_does_not_stall_worse_ones() -> None:
    # Its adapter is still being read: the step it cannot join runs the worse work instead.
    slots = Slots(num_slots=1)
    clock = Clock()
    sched = guarded(clock, adapters=slots)
    decoding_lows(sched, 2)
    clock.now += 10
    held = make_seq(6, "held", 0, start=200)
    held.lora_name = "sql"
    sched.add(held)
    out = run_step(sched)
    assert out.preempted == [] and plan(out) == [("low0", 1), ("low1", 1)]
    slots.readable.add("sql")
    assert plan(run_step(sched)) == [("held", 6)]


def test_equal_ranks_and_fcfs_fill_the_step() -> None:
    for policy, priorities in (("priority", (1, 1)), ("fcfs", (1, -1))):
        clock = Clock()
        sched = guarded(clock, policy=policy)
        decoding_lows(sched, 5, priorities[0])
        sched.add(make_seq(6, "other", priorities[1], start=200))
        out = run_step(sched)
        assert plan(out) == [*((f"low{i}", 1) for i in range(5)), ("other", 6)], policy


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("guard_window_s", -1.0, "guard_window_s must be >= 0"),
        ("guard_step_tokens", 0, "guard_step_tokens must be >= 1"),
        ("guard_step_seqs", 0, "guard_step_seqs must be >= 1"),
    ],
)
def test_a_bad_guard_is_refused(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{field: value})


def test_async_scheduling_isolates_a_better_prefill_and_guards_the_steps_beside_it() -> None:
    """The engine's overlapped steps (step N+1 scheduled while N runs) through the same
    decisions: a worse decode with its token in flight sits a step out and resumes intact."""
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(dtype="float32", async_scheduling=True, policy="priority", guard_step_tokens=2)
    engine = llm.engine
    plans: list[list[tuple[str, int]]] = []
    schedule = engine.core.scheduler.schedule

    def recorded() -> object:
        out = schedule()
        plans.append(plan(out))
        return out

    engine.core.scheduler.schedule = recorded  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"low{i}", [1, *range(300 + 9 * i, 308 + 9 * i)], params, priority=1)
    outputs: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    engine.add_request("high", [1, *range(500, 530)], params, priority=-1)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    assert [("high", 31)] in plans  # its prefill: a step of its own
    # Then the lows share 2 tokens of each step beside its decodes, and all finish.
    beside = [p for p in plans if ("high", 1) in p]
    assert beside and all(1 < len(p) <= 3 for p in beside), plans
    assert sorted(outputs) == ["high", "low0", "low1", "low2"]
    assert all(len(t) == 5 for t in outputs.values())
    assert engine.core.in_flight is None and engine.block_manager.usage == 0.0
    # A declared better priority reaches the scheduler through the engine's request path.
    assert -2 not in engine.core.scheduler.last_seen
    engine.add_request("declared", [1, 2, 3], params, priority=1, guard_priority=-2)
    engine.step()
    assert -2 in engine.core.scheduler.last_seen


def test_the_guard_bounds_worse_sequences_and_tokens_apart() -> None:
    clock = Clock()
    sched = scheduler(
        isolate=True, guard_window_s=2.0, guard_step_seqs=2, guard_step_tokens=8, clock=clock
    )
    decoding_lows(sched, 3)
    sched.add(make_seq(6, "high", 0, start=200))
    run_step(sched)
    assert plan(run_step(sched)) == [("low0", 1), ("low1", 1), ("high", 1)]  # two sequences
    sched.finish(sched.running[0])
    sched.finish(sched.running[0])
    sched.add(make_seq(20, "late", 2, start=400))
    # One decode and one prompt chunk: the tokens left (7) bound the chunk.
    assert plan(run_step(sched)) == [("low2", 1), ("high", 1), ("late", 7)]
