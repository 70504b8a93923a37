"""What one request may ask of the server, each limit a flag of `kvpilot serve` with a safe
default, and the checks that enforce them (all but the body size on already-parsed JSON)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.contract import errors


@dataclass(frozen=True)
class RequestLimits:
    """Picklable: preprocessing checks them in a worker process too."""

    max_body_bytes: int = 32 * 2**20
    max_json_depth: int = 32  # an OpenAI body nests 5-6 deep
    max_sequences: int = 256  # prompts x n per request
    max_stop: int = 16  # stop strings per request (OpenAI allows 4)
    max_logit_bias: int = 300  # logit_bias entries per request (OpenAI's own limit)
    # Tokens one sequence may generate; None: only the model's context bounds it.
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_sequences", "max_stop"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logit_bias < 0:
            raise ValueError(f"max_logit_bias must be >= 0, got {self.max_logit_bias}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def check_json(value: Any, max_depth: int) -> None:
    """400 for JSON nested deeper than max_depth, or with a string that is not valid Unicode (a
    lone surrogate such as "\\ud800": JSON can spell it, UTF-8 cannot carry it)."""
    # Iterative, so that the check itself cannot run out of stack.
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise errors.bad_request(
                        f"{path or 'the body'}: the string holds a lone surrogate "
                        f"({item[exc.start]!r}) at character {exc.start}; send valid Unicode.",
                        param=path.split(".")[0] or None,
                    ) from None
            continue
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise too_deep(max_depth)
            children = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in children:
                if isinstance(key, str):
                    check_json(key, max_depth)  # keys are strings too
                if isinstance(child, (str, dict, list)):
                    stack.append((child, depth + 1, f"{path}.{key}" if path else str(key)))


def too_deep(max_depth: int) -> errors.APIError:
    return errors.bad_request(
        f"The request body nests JSON deeper than {max_depth} levels.", code="json_too_deep"
    )


def check_fan_out(num_prompts: int, n: int, limits: RequestLimits) -> None:
    """n here is the sequences generated per prompt: max(n, best_of) where best_of is allowed."""
    if num_prompts * n > limits.max_sequences:
        raise errors.bad_request(
            f"This request asks for {num_prompts} prompt(s) x {n} sequence(s) each = "
            f"{num_prompts * n} sequences; the limit is {limits.max_sequences} per request.",
            param="n",
            code="too_many_sequences",
        )


def check_stop(stop: str | list[str] | None, limits: RequestLimits) -> None:
    if isinstance(stop, list) and len(stop) > limits.max_stop:
        raise errors.bad_request(
            f"{len(stop)} stop strings; the limit is {limits.max_stop}.", param="stop"
        )


def check_logit_bias(
    logit_bias: dict[str, float] | None, vocab_size: int, limits: RequestLimits
) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs, or a 400: too many entries,
    a key that is not a token id of this model's vocabulary."""
    if not logit_bias:
        return ()
    if len(logit_bias) > limits.max_logit_bias:
        raise errors.bad_request(
            f"logit_bias has {len(logit_bias)} entries; the limit is {limits.max_logit_bias}.",
            param="logit_bias",
            code="too_many_logit_bias",
        )
    pairs = []
    for key, bias in logit_bias.items():
        token = int(key) if key.isascii() and key.isdecimal() else -1
        if not 0 <= token < vocab_size:
            raise errors.bad_request(
                f"logit_bias: {key[:32]!r} is not a token id of this model (an integer in "
                f"[0, {vocab_size})).",
                param="logit_bias",
            )
        pairs.append((token, bias))
    return tuple(pairs)


def check_max_tokens(requested: int | None, limits: RequestLimits) -> None:
    if limits.max_tokens is not None and requested is not None and requested > limits.max_tokens:
        raise errors.bad_request(
            f"max_tokens is {requested}; this server allows at most {limits.max_tokens}.",
            param="max_tokens",
        )
