"""Continuous batching under a per-step token budget, with chunked prefill and preemption by
recompute.

Each step: running decodes first (a stream never stalls behind a long prompt), then running prefills
that were cut into chunks, then waiting requests in queue order, until the token budget
(max_num_batched_tokens) or max_num_seqs is reached. A waiting request whose grammar is still
compiling is passed over (it keeps its place) rather than make every step wait for its mask, and so
is one whose LoRA adapter is still being read or finds every adapter slot in use. When
the KV pool runs dry, a running sequence is preempted: its blocks go back (its full blocks stay in
the prefix cache) and it waits at the front of its place in the queue to be recomputed.

The policy (SchedulerConfig.policy) is one rank per sequence, lower served first: 0 for all under
fcfs, the request's priority under priority. The queue is kept in rank order, arrival order within a
rank (a preempted sequence goes before the others of its rank, as fcfs puts it at the front); the
KV victim is the last admitted running sequence of the worst rank (under fcfs: the newest); and a
waiting sequence of a strictly better rank than a running one, which finds no sequence slot or no
KV blocks free, takes them from the worst. With equal ranks the policies schedule alike.

A step cannot be interrupted, so what bounds a better request's time to its first token is the
step it arrives into and the steps its prefill shares. Under priority, when ranks differ:
- Isolation (isolate_prefills). While a sequence of rank r has prompt tokens to compute
  (waiting, its grammar ready, or running a chunked prefill), the step holds only work of rank r
  or better: worse decodes and prefills skip it (they keep their places, blocks and slots). The
  better prefill runs as fast as alone. Should that leave the step empty (the better one waits
  for an adapter or for blocks no worse sequence holds), the step is scheduled as if it did not
  wait.
- Guard (guard_window_s, guard_step_seqs, guard_step_tokens). For guard_window_s after a rank
  last had a sequence here (waiting or running), or was declared by one (a sequence's
  guard_priority: a better rank the platform expects, e.g. a premium tenant active on the model,
  so that the bound holds before that rank's first request arrives rather than from the step
  after it), the ranks worse than it share guard_step_seqs
  sequences and guard_step_tokens tokens of each step: their decodes, prefill chunks and resumed
  (preempted) sequences' recompute together, in queue and admission order. A better request
  arriving meanwhile finds a step of at most that much worse work ahead of it. Worse ranks still
  progress while the better ones only decode: they join those steps, within the guard.
Equal ranks are neither isolated from nor guarded against each other, so a single rank schedules
exactly as fcfs.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv_cache.block_manager import BlockManager
from kvpilot.engine.sequence import Sequence, SequenceStatus
from kvpilot.engine.structured.manager import SequenceGrammar


class AdapterSlots(Protocol):
    """Where a sequence's LoRA adapter runs (engine/lora/manager.LoRAManager)."""

    def slot_for(self, name: str, busy: set[str]) -> int | None:
        """Its slot, taking one if it must (never one of an adapter in `busy`); None: wait."""
        ...


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    # The last num_spec_tokens of the chunk are the sequence's first proposals (spec_token_ids),
    # verified in this step.
    num_spec_tokens: int = 0

    @property
    def will_sample(self) -> bool:
        """This chunk reaches the end of the sequence's known tokens, so the step samples a
        token."""
        return (
            self.seq.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens
            == self.seq.num_tokens
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _StepLimits:
    """What one step may hold beyond the token budget (None: no bound): only ranks up to
    `cutoff` (isolation), and for the ranks worse than `guard` at most `guarded_seqs` sequences
    and `guarded_tokens` tokens."""

    cutoff: int | None = None
    guard: int | None = None
    guarded_seqs: int = 0
    guarded_tokens: int = 0

    def allows(self, rank: int) -> bool:
        if self.cutoff is not None and rank > self.cutoff:
            return False
        return not self.is_guarded(rank) or (self.guarded_seqs > 0 and self.guarded_tokens > 0)

    def is_guarded(self, rank: int) -> bool:
        return self.guard is not None and rank > self.guard

    def cap(self, rank: int, num_tokens: int) -> int:
        return min(num_tokens, self.guarded_tokens) if self.is_guarded(rank) else num_tokens

    def spend(self, rank: int, num_tokens: int) -> None:
        if self.is_guarded(rank):
            self.guarded_seqs -= 1
            self.guarded_tokens -= num_tokens

    def refund(self, rank: int, num_tokens: int) -> None:
        if self.is_guarded(rank):
            self.guarded_seqs += 1
            self.guarded_tokens += num_tokens


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        adapters: AdapterSlots | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()  # in rank order, arrival order within a rank
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.num_preemptions = 0
        self.by_priority = config.policy == "priority"
        self.clock = clock
        self.last_seen: dict[int, float] = {}  # rank -> when it last had a sequence here

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind every waiting one of its rank or better."""
        seq.status = SequenceStatus.WAITING
        rank = self.rank(seq)
        index = len(self.waiting)
        while index > 0 and self.rank(self.waiting[index - 1]) > rank:
            index -= 1
        self.waiting.insert(index, seq)

    def rank(self, seq: Sequence) -> int:
        """Where the policy puts seq: lower is served first and preempted last."""
        return seq.priority if self.by_priority else 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        limits = self._limits()
        out = self._schedule(limits)
        if out.is_empty and not out.preempted and limits.cutoff is not None:
            # The better work could not start (see the module's docstring): no isolation.
            unisolated = _StepLimits(None, limits.guard, limits.guarded_seqs, limits.guarded_tokens)
            out = self._schedule(unisolated)
        return out

    def _limits(self) -> _StepLimits:
        """This step's isolation and guard (none under fcfs, nor while ranks are equal)."""
        if not self.by_priority:
            return _StepLimits()
        now = self.clock()
        ranks = {self.rank(s) for s in self.running}
        ranks.update(self.rank(s) for s in self.waiting)
        for rank in ranks:
            self.last_seen[rank] = now
        # A better rank a sequence declares (the platform expects its requests) counts as seen:
        # its bound holds before its first request arrives.
        for seq in itertools.chain(self.running, self.waiting):
            if seq.guard_priority is not None and seq.guard_priority < seq.priority:
                self.last_seen[seq.guard_priority] = now
        window = self.config.guard_window_s
        # Only the ranks inside the window are kept: clients may send any integer priority.
        self.last_seen = {r: seen for r, seen in self.last_seen.items() if now - seen <= window}
        guard = min(self.last_seen) if window > 0 and self.last_seen else None
        prefilling = [self.rank(s) for s in self.running if not s.is_decoding]
        prefilling += [
            self.rank(s)
            for s in self.waiting
            if s.grammar is None or s.grammar.is_ready  # one still compiling cannot start
        ]
        cutoff = min(prefilling, default=None) if self.config.isolate_prefills else None
        return _StepLimits(
            cutoff if ranks and cutoff is not None and max(ranks) > cutoff else None,
            guard,
            self.config.guard_step_seqs,
            self.config.guard_step_tokens,
        )

    def _schedule(self, limits: _StepLimits) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        by_seq: dict[int, ScheduledSequence] = {}

        # A sequence whose token in flight ends it (async scheduling) has nothing left to compute.
        decodes = [s for s in self.running if s.is_decoding and not s.reached_length]
        prefills = [s for s in self.running if not s.is_decoding]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            rank = self.rank(seq)
            if not limits.allows(rank):
                continue  # it keeps its place, its blocks and its slot
            # A decode with proposals is a query of its last token and the proposals (as many
            # as the budget leaves room for).
            wanted = seq.num_uncomputed_tokens + len(seq.spec_token_ids)
            num_new = limits.cap(rank, min(wanted, budget))
            while not self.block_manager.allocate(seq, num_new):
                victim = self._worst(self.running)
                budget += self._preempt(victim, out, by_seq, limits)
                if victim is seq:
                    break
            else:
                num_spec = max(0, num_new - seq.num_uncomputed_tokens)
                by_seq[seq.seq_id] = ScheduledSequence(seq, num_new, num_spec)
                budget -= num_new
                limits.spend(rank, num_new)

        # New work waits while the pool is under pressure (it would only be preempted again).
        if not out.preempted:
            budget = self._admit_waiting(budget, out, by_seq, limits)
        out.scheduled = list(by_seq.values())
        return out

    def _admit_waiting(
        self,
        budget: int,
        out: SchedulerOutput,
        by_seq: dict[int, ScheduledSequence],
        limits: _StepLimits,
    ) -> int:
        bm = self.block_manager
        passed_over: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            rank = self.rank(seq)
            if not limits.allows(rank):
                break  # the queue is in rank order: the rest are no better
            if seq.grammar is not None and not seq.grammar.is_ready:
                passed_over.append(self.waiting.popleft())
                continue
            # A full batch or a spent budget: only a strictly worse running sequence may give
            # its place (and its tokens in this step) up.
            displaced = None
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                displaced = self._displaceable(seq)
                if displaced is None:
                    break
            if seq.lora_name is not None and not self._take_adapter_slot(seq):
                passed_over.append(self.waiting.popleft())
                continue
            if displaced is not None:
                budget += self._preempt(displaced, out, by_seq, limits)
                if budget == 0:
                    break  # its place is free from the next step on
            cached = bm.find_cached_prefix(seq) if not seq.block_table else []
            num_computed = len(cached) * bm.block_size
            num_new = limits.cap(rank, min(seq.num_tokens - num_computed, budget))
            is_allocated = bm.allocate(seq, num_new, cached)
            while not is_allocated and (displaced := self._displaceable(seq)) is not None:
                budget += self._preempt(displaced, out, by_seq, limits)
                num_new = limits.cap(rank, min(seq.num_tokens - num_computed, budget))
                is_allocated = bm.allocate(seq, num_new, cached)
            if not is_allocated:
                break
            self.waiting.popleft()
            bm.record_prefix_query(seq.num_tokens, num_computed)
            seq.num_computed_tokens = num_computed
            if not seq.was_admitted:
                seq.was_admitted = True
                seq.num_cached_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            by_seq[seq.seq_id] = ScheduledSequence(seq, num_new)
            budget -= num_new
            limits.spend(rank, num_new)
        self.waiting.extendleft(reversed(passed_over))
        return budget

    def release_unneeded_blocks(self, seq: Sequence) -> None:
        """Return the tail blocks seq's table holds past its tokens (they held rejected
        proposals, whose KV the next step overwrites anyway). Never published: the prefix cache
        only takes blocks of computed tokens."""
        bm = self.block_manager
        keep = bm.num_blocks_for(seq.num_tokens)
        while len(seq.block_table) > keep:
            bm.pool.release(seq.block_table.pop())

    def _take_adapter_slot(self, seq: Sequence) -> bool:
        """Gives seq its adapter's slot; False while the adapter is being read or every slot
        holds an adapter that running sequences use (it waits, keeping its place)."""
        assert self.adapters is not None and seq.lora_name is not None
        busy = {s.lora_name for s in self.running if s.lora_name is not None}
        slot = self.adapters.slot_for(seq.lora_name, busy)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def waits_on_adapters(self) -> bool:
        """Nothing runs and a waiting sequence's adapter is what holds it back."""
        return not self.running and any(s.lora_name is not None for s in self.waiting)

    def compiling_grammars(self) -> list[SequenceGrammar]:
        """The grammars that hold waiting sequences back, when nothing else can run (empty
        otherwise): what the step loop may wait on instead of spinning."""
        held = [s.grammar for s in self.waiting if s.grammar is not None and not s.grammar.is_ready]
        return held if not self.running and len(held) == len(self.waiting) else []

    def _worst(self, seqs: list[Sequence]) -> Sequence:
        """The last of the worst rank among seqs (running: the last admitted)."""
        worst = max(self.rank(s) for s in seqs)
        return next(s for s in reversed(seqs) if self.rank(s) == worst)

    def _displaceable(self, seq: Sequence) -> Sequence | None:
        """The running sequence that waiting seq may preempt to start: the worst, if its rank is
        strictly worse than seq's (never one that ends with its token in flight)."""
        candidates = [s for s in self.running if not s.reached_length]
        if not candidates:
            return None
        victim = self._worst(candidates)
        return victim if self.rank(victim) > self.rank(seq) else None

    def _preempt(
        self,
        seq: Sequence,
        out: SchedulerOutput,
        by_seq: dict[int, ScheduledSequence],
        limits: _StepLimits,
    ) -> int:
        """Send a running sequence back to wait, before the others of its rank; returns the
        tokens it had been given in this step (now free again, in the guard's share too)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        rank = self.rank(seq)
        index = 0
        while index < len(self.waiting) and self.rank(self.waiting[index]) < rank:
            index += 1
        self.waiting.insert(index, seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        scheduled = by_seq.pop(seq.seq_id, None)
        if scheduled is None:
            return 0
        limits.refund(rank, scheduled.num_new_tokens)
        return scheduled.num_new_tokens
