"""Per-request sampling parameters, validated at construction (ValueError names the field)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.structured.spec import StructuredSpec


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = (
        None  # number of top logprobs to return per token, besides the sampled one
    )
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    # (token id, bias) added to that token's logit before any other sampling step (OpenAI's
    # logit_bias: -100 bans a token, +100 all but forces it); the reported logprobs stay raw.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Grammar-constrained decoding (JSON schema, regex, choice, EBNF); None: free text.
    structured: StructuredSpec | None = None
    # What the output is expected to repeat for the most part (OpenAI's Predicted Outputs, as
    # tokens): speculation proposes from it first (spec_decode/prediction.py).
    prediction_token_ids: tuple[int, ...] = ()
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists (and a lone string) for convenience; store tuples so the object stays
        # hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "prediction_token_ids", tuple(self.prediction_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            fail("max_tokens", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            fail("logprobs", "must be an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if any(not isinstance(t, int) or t < 0 for t in self.prediction_token_ids):
            fail("prediction_token_ids", "must be non-negative integers")
        if any(
            not isinstance(t, int) or t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias
        ):
            fail("logit_bias", "must map non-negative token ids to biases in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            fail("logit_bias", "must name each token id once")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def stop_holdback_chars(self) -> int:
        """Characters held back from a stream so that a stop string is never partly sent."""
        return max((len(s) for s in self.stop), default=1) - 1
