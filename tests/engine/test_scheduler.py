"""Scheduler policy on plain Python state: budgets, chunking, decode priority, preemption, abort."""

from __future__ import annotations

from concurrent.futures import Future

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv_cache.block_manager import BlockManager
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler, SchedulerOutput
from kvpilot.engine.sequence import Sequence, SequenceStatus
from kvpilot.engine.structured.manager import SequenceGrammar

BS = 4


def make_seq(n: int, rid: str, start: int = 0) -> Sequence:
    tokens = list(range(start, start + n))
    return Sequence(rid, 0, tokens, n, SamplingParams())


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


def test_long_prompt_is_chunked_and_decodes_go_first() -> None:
    bm = BlockManager(num_blocks=64, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8), bm)
    short = make_seq(3, "short")
    sched.add(short)
    assert plan(run_step(sched)) == [("short", 3)]  # prefill, samples a token
    long = make_seq(20, "long", start=100)
    sched.add(long)
    # Every step: the running decode first (1 token), then 7 tokens of the long prompt.
    assert plan(run_step(sched)) == [("short", 1), ("long", 7)]
    assert plan(run_step(sched)) == [("short", 1), ("long", 7)]
    assert plan(run_step(sched)) == [("short", 1), ("long", 6)]  # last chunk: samples
    assert long.num_output_tokens == 1
    assert plan(run_step(sched)) == [("short", 1), ("long", 1)]


def test_max_num_seqs_and_token_budget_bound_admission() -> None:
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=2), bm)
    for i in range(3):
        sched.add(make_seq(5, f"r{i}", start=10 * i))
    assert plan(run_step(sched)) == [("r0", 5), ("r1", 5)]
    assert sched.num_waiting == 1 and sched.num_running == 2


def test_newest_running_is_preempted_and_resumes_from_the_front() -> None:
    # 4 blocks of 4 tokens; two sequences of 7 tokens take 2 blocks each, until position 8.
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), bm)
    old, new = make_seq(7, "old"), make_seq(7, "new", start=50)
    sched.add(old)
    sched.add(new)
    assert plan(run_step(sched)) == [("old", 7), ("new", 7)]  # 8 tokens each now, 2 blocks each
    assert plan(run_step(sched)) == [("old", 1), ("new", 1)]  # position 7 still fits in block 2
    out = run_step(sched)  # position 8 needs a third block each: none free -> preempt the newest
    assert [s.request_id for s in out.preempted] == ["new"]
    assert plan(out) == [("old", 1)]
    assert new.status is SequenceStatus.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and list(sched.waiting) == [new]
    assert sched.num_preemptions == 1
    bm.check_integrity([old, new])
    # When old finishes, new is recomputed in full (prompt + its generated token) and continues.
    sched.finish(old)
    assert plan(run_step(sched)) == [("new", 9)]
    assert new.num_output_tokens == 3
    bm.check_integrity([new])


def test_preempting_the_only_sequence_never_loses_it() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), bm)
    seq = make_seq(8, "solo")
    sched.add(seq)
    run_step(sched)  # 9 tokens now, pool holds 8: it preempts itself and waits
    out = run_step(sched)
    assert [s.request_id for s in out.preempted] == ["solo"] and out.is_empty
    assert list(sched.waiting) == [seq]


def test_abort_returns_every_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=8), bm)
    a, b = make_seq(9, "a"), make_seq(9, "b", start=30)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a gets 6 tokens (chunk), b waits
    assert a.block_table and bm.num_free_blocks < 16
    sched.finish(a)  # abort mid-prefill
    sched.finish(b)  # abort while waiting
    assert bm.num_free_blocks == 16 and bm.usage == 0.0
    assert not sched.has_unfinished()
    bm.check_integrity([a, b])


def test_waiting_request_reuses_a_running_requests_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), bm)
    a = make_seq(10, "a")
    sched.add(a)
    run_step(sched)
    b = make_seq(10, "b")  # same tokens as a's prompt
    sched.add(b)
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 2)]  # 8 of b's 10 tokens come from the cache
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2


def test_a_request_whose_grammar_compiles_is_passed_over_and_keeps_its_place() -> None:
    """Until its grammar is compiled a constrained request waits, and those behind it go first;
    nothing else waiting, the scheduler names the grammars a step loop may wait on."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), bm)
    backend: Future[object] = Future()
    backend.set_result(object())
    compiled: Future[object] = Future()
    held = make_seq(5, "held")
    held.grammar = SequenceGrammar(backend, compiled)  # type: ignore[arg-type]
    sched.add(held)
    assert plan(run_step(sched)) == []
    assert sched.compiling_grammars() == [held.grammar]
    free = [make_seq(5, f"free{i}", start=10 * (i + 1)) for i in range(2)]
    for seq in free:
        sched.add(seq)
    assert plan(run_step(sched)) == [("free0", 5), ("free1", 5)]
    assert list(sched.waiting) == [held] and sched.compiling_grammars() == []  # others run
    later = make_seq(5, "later", start=100)
    sched.add(later)
    compiled.set_result(object())
    # Ready now: admitted in its place, before what arrived after it.
    assert plan(run_step(sched)) == [("free0", 1), ("free1", 1), ("held", 5), ("later", 5)]
