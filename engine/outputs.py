"""What the engine hands back per request and step: cumulative texts and token lists, or, for an
OutputKind.DELTA request, only what each step added."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class OutputKind(enum.Enum):
    """How a request's outputs arrive (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # after every step, everything so far
    DELTA = "delta"  # after every step, only what it added: O(1) per token at any length
    FINAL_ONLY = "final_only"  # once, everything, when the request finishes


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # Speculation so far, over the request's sequences: proposed tokens verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    extra: dict[str, object] = field(default_factory=dict)


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One DELTA output holding what two consecutive ones hold (a reader that fell behind). Each
    output lists every sequence of its request, in order."""
    merged = []
    for old, new in zip(older.outputs, newer.outputs, strict=True):
        logprobs = None
        if old.logprobs is not None or new.logprobs is not None:
            logprobs = (old.logprobs or []) + (new.logprobs or [])
        merged.append(
            replace(
                new,
                text=old.text + new.text,
                token_ids=old.token_ids + new.token_ids,
                logprobs=logprobs,
            )
        )
    return replace(newer, outputs=merged)
