"""The engine core's state of one generated sequence (a request with n > 1 has n of them): token
ids and KV bookkeeping, no text. No policy lives here."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.structured.manager import SequenceGrammar

_seq_counter = itertools.count()

# A sampled token still on the device (async scheduling): what the next step's input reads is the
# device copy, and the host fills this place in when it reads the step's tokens.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]  # prompt then output
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    # Leading prompt tokens shared with every salt (a platform's common system prompt): the full
    # blocks inside them are cached without cache_salt.
    shared_prefix_tokens: int = 0
    # Its scheduling priority (vLLM's: lower is served first); ignored by the fcfs policy.
    priority: int = 0
    # A better priority the platform expects: the priority policy guards against it while this
    # sequence is here (contract.openai's kvpilot_guard_priority). None: none declared.
    guard_priority: int | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    generator: torch.Generator | None = None
    grammar: SequenceGrammar | None = None  # its position in its constraint, if it has one
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain of the full blocks so far
    # Leading blocks of block_table the prefix cache has already looked at (published, or left
    # private because another block held the same content first): each step looks past them only.
    num_published_blocks: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    was_admitted: bool = False
    finish_reason: str | None = None
    stop_reason: int | None = None
    # Trailing token_ids that are PENDING_TOKEN (at most two: one per step in flight).
    num_pending_tokens: int = 0
    # The pending token's row in the last launched step's samples, while it has one.
    pending_row: int | None = None
    # The device slot of its adapter while it runs (-1: none); taken again on each admission.
    lora_slot: int = -1
    # Set when the token just launched reaches max_tokens or the context: nothing is left to
    # schedule; the sequence finishes once that token is read.
    reached_length: bool = False
    # Proposed tokens for the next step (speculative decoding): not in token_ids until accepted.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host holds (all but the pending ones)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def is_decoding(self) -> bool:
        """Prefill done: one new token per step from here on."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
