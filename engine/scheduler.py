"""Continuous batching under a per-step token budget, with chunked prefill and preemption by
recompute.

Each step: running decodes first (a stream never stalls behind a long prompt), then running prefills
that were cut into chunks, then waiting requests in arrival order, until the token budget
(max_num_batched_tokens) or max_num_seqs is reached. A waiting request whose grammar is still
compiling is passed over (it keeps its place) rather than make every step wait for its mask, and so
is one whose LoRA adapter is still being read or finds every adapter slot in use. When
the KV pool runs dry, the newest running sequence is preempted: its blocks go back (its full blocks
stay in the prefix cache) and it waits at the front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
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

    @property
    def will_sample(self) -> bool:
        """This chunk reaches the end of the sequence's known tokens, so the step samples a
        token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


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


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

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
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim.seq_id in by_seq:
                    budget += by_seq.pop(victim.seq_id).num_new_tokens
                if victim is seq:
                    break
            else:
                by_seq[seq.seq_id] = ScheduledSequence(seq, num_new)
                budget -= num_new

        # New work waits while the pool is under pressure (it would only be preempted again).
        if not out.preempted:
            budget = self._admit_waiting(budget, by_seq)
        out.scheduled = list(by_seq.values())
        return out

    def _admit_waiting(self, budget: int, by_seq: dict[int, ScheduledSequence]) -> int:
        bm = self.block_manager
        passed_over: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.grammar is not None and not seq.grammar.is_ready:
                passed_over.append(self.waiting.popleft())
                continue
            if seq.lora_name is not None and not self._take_adapter_slot(seq):
                passed_over.append(self.waiting.popleft())
                continue
            cached = bm.find_cached_prefix(seq) if not seq.block_table else []
            num_computed = len(cached) * bm.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if not bm.allocate(seq, num_new, cached):
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
        self.waiting.extendleft(reversed(passed_over))
        return budget

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

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
