"""When the engine speculates, and how much: the one place of the back-off rule.

A running sequence gets proposals in a step when all of these hold:
- It decodes (its prompt is computed) with no token in flight. A grammar, penalties and
  logprobs follow each proposal (verify.py; a grammar also cuts the proposals, grammar.py).
- At most `disable_by_batch_size` sequences run: past that the batch already fills the compute a
  step has, and verifying k more tokens per sequence would slow every stream.
- Its measured acceptance (accepted / proposed tokens, a moving average over its steps) is at
  least `min_acceptance`; below it, only every PROBE_EVERY-th step proposes for it, to measure it
  again. Each sequence goes by its own: a copying request keeps speculating beside requests whose
  proposals miss. Before its first verification a sequence starts from the engine's acceptance
  over every sequence's proposals (what this server's traffic gets), or from full confidence
  where it brings a prediction (OpenAI's Predicted Outputs: the client expects the output).
- The proposal never reaches past max_tokens or the context: at most
  min(num_speculative_tokens, tokens left - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.config import SpeculativeConfig
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.spec_decode.ngram import NgramProposer
from kvpilot.engine.spec_decode.prediction import propose_with_predictions
from kvpilot.engine.spec_decode.proposer import Proposer

# While acceptance is low, one step in this many still proposes, so that the average can recover.
PROBE_EVERY = 16
# Weight of a step's acceptance in the engine's moving average (over every sequence).
ACCEPTANCE_EMA_WEIGHT = 0.1
# ... and in a sequence's own: a request lives for few steps, so its own misses must count within
# a few (at 0.1, the free-writing half of a mixed batch went on proposing for nothing longer than
# the engine-wide average had let it: bench/spec_backoff_mix.py's mixed workload).
SEQ_ACCEPTANCE_EMA_WEIGHT = 0.3


@dataclass
class SpecDecodeCounters:
    """Cumulative, as vLLM's spec_decode counters: proposals made (drafts), their tokens, the
    accepted ones, and accepted ones by position in the draft (0-based)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def moving_average(average: float, value: float, weight: float) -> float:
    """The exponential moving average after one more value of the given weight."""
    return (1 - weight) * average + weight * value


def speculates(seq: Sequence) -> bool:
    """Whether this sequence may get proposals at all (see the module's docstring)."""
    return seq.num_pending_tokens == 0 and seq.is_decoding


class SpeculationPolicy:
    def __init__(
        self, config: SpeculativeConfig, max_seq_len: int, proposer: Proposer | None = None
    ) -> None:
        """proposer: what makes the proposals (None: n-gram lookup with the config's sizes)."""
        self.config = config
        self.max_seq_len = max_seq_len
        self.proposer: Proposer = proposer or NgramProposer(
            min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max
        )
        # Over every sequence's proposals: where a new sequence starts (optimistic until measured).
        self.acceptance = 1.0
        self.seq_acceptance: dict[int, float] = {}  # by seq_id, the running ones that proposed
        self.num_steps = 0
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, running: list[Sequence]) -> None:
        """Sets each running sequence's spec_token_ids for the next step (empty: none)."""
        self.num_steps += 1
        fits = len(running) <= self.config.disable_by_batch_size
        probing = self.num_steps % PROBE_EVERY == 0
        self.proposer.keep_only(running)
        self.seq_acceptance = {
            seq.seq_id: self.seq_acceptance[seq.seq_id]
            for seq in running
            if seq.seq_id in self.seq_acceptance
        }
        seqs, nums = [], []
        for seq in running:
            seq.spec_token_ids = []
            if not (fits and speculates(seq)):
                continue
            if self.acceptance_of(seq) < self.config.min_acceptance and not probing:
                continue
            num = self._num_proposals(seq)
            if num >= 1:
                seqs.append(seq)
                nums.append(num)
        if seqs:
            proposals = propose_with_predictions(
                self.proposer,
                seqs,
                nums,
                min_n=self.config.prompt_lookup_min,
                max_n=self.config.prompt_lookup_max,
            )
            for seq, proposal in zip(seqs, proposals, strict=True):
                seq.spec_token_ids = proposal

    def acceptance_of(self, seq: Sequence) -> float:
        """The sequence's acceptance, or where it starts before its first verification."""
        known = self.seq_acceptance.get(seq.seq_id)
        if known is not None:
            return known
        return 1.0 if seq.params.prediction_token_ids else self.acceptance

    def _num_proposals(self, seq: Sequence) -> int:
        left = self.max_seq_len - seq.num_tokens
        max_tokens = seq.params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - seq.num_output_tokens)
        return min(self.config.num_speculative_tokens, left - 1)

    def record(self, results: list[tuple[Sequence, int, int]]) -> None:
        """One step's verifications: (the sequence, proposed tokens, accepted tokens) per
        speculating sequence."""
        c = self.counters
        proposed = accepted = 0
        for seq, num_draft, num_accepted in results:
            if num_draft == 0:
                continue
            self.seq_acceptance[seq.seq_id] = moving_average(
                self.acceptance_of(seq), num_accepted / num_draft, SEQ_ACCEPTANCE_EMA_WEIGHT
            )
            c.num_drafts += 1
            c.num_draft_tokens += num_draft
            c.num_accepted_tokens += num_accepted
            for pos in range(num_accepted):
                c.accepted_per_pos[pos] += 1
            proposed += num_draft
            accepted += num_accepted
        if proposed:
            self.acceptance = moving_average(
                self.acceptance, accepted / proposed, ACCEPTANCE_EMA_WEIGHT
            )
