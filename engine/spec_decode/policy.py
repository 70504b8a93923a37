"""When the engine speculates, and how much: the one place of the back-off rule.

A running sequence gets proposals in a step when all of these hold:
- It decodes (its prompt is computed) with no token in flight. A grammar, penalties and
  logprobs follow each proposal (verify.py; a grammar also cuts the proposals, grammar.py).
- At most `disable_by_batch_size` sequences run: past that the batch already fills the compute a
  step has, and verifying k more tokens per sequence would slow every stream.
- The measured acceptance (accepted / proposed tokens, a moving average over steps) is at least
  `min_acceptance`; below it, only every PROBE_EVERY-th step proposes, to measure it again.
- The proposal never reaches past max_tokens or the context: at most
  min(num_speculative_tokens, tokens left - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.config import SpeculativeConfig
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.spec_decode.ngram import NgramProposer
from kvpilot.engine.spec_decode.proposer import Proposer

# While acceptance is low, one step in this many still proposes, so that the average can recover.
PROBE_EVERY = 16
# Weight of a step's acceptance in the moving average.
ACCEPTANCE_EMA_WEIGHT = 0.1


@dataclass
class SpecDecodeCounters:
    """Cumulative, as vLLM's spec_decode counters: proposals made (drafts), their tokens, the
    accepted ones, and accepted ones by position in the draft (0-based)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


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
        self.acceptance = 1.0  # optimistic until measured
        self.num_steps = 0
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, running: list[Sequence]) -> None:
        """Sets each running sequence's spec_token_ids for the next step (empty: none)."""
        self.num_steps += 1
        active = len(running) <= self.config.disable_by_batch_size and (
            self.acceptance >= self.config.min_acceptance or self.num_steps % PROBE_EVERY == 0
        )
        self.proposer.keep_only(running)
        seqs, nums = [], []
        for seq in running:
            seq.spec_token_ids = []
            num = self._num_proposals(seq) if active and speculates(seq) else 0
            if num >= 1:
                seqs.append(seq)
                nums.append(num)
        if seqs:
            for seq, proposal in zip(seqs, self.proposer.propose(seqs, nums), strict=True):
                seq.spec_token_ids = proposal

    def _num_proposals(self, seq: Sequence) -> int:
        left = self.max_seq_len - seq.num_tokens
        max_tokens = seq.params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - seq.num_output_tokens)
        return min(self.config.num_speculative_tokens, left - 1)

    def record(self, results: list[tuple[int, int]]) -> None:
        """One step's verifications: (proposed tokens, accepted tokens) per speculating
        sequence."""
        c = self.counters
        proposed = accepted = 0
        for num_draft, num_accepted in results:
            if num_draft == 0:
                continue
            c.num_drafts += 1
            c.num_draft_tokens += num_draft
            c.num_accepted_tokens += num_accepted
            for pos in range(num_accepted):
                c.accepted_per_pos[pos] += 1
            proposed += num_draft
            accepted += num_accepted
        if proposed:
            w = ACCEPTANCE_EMA_WEIGHT
            self.acceptance = (1 - w) * self.acceptance + w * accepted / proposed
