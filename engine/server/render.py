"""Pure builders of OpenAI response bodies and stream chunks from engine outputs (no I/O).

Completions and chat differ in more than names: completions logprobs are parallel lists
(`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob} holding the top-N *plus* the sampled
token, `text_offset`), chat logprobs are a list of objects (`token`, `logprob`, `bytes`,
`top_logprobs` with exactly the top-N in rank order). A stream gets the engine's DELTA outputs and
counts what it sent in a cursor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpilot.engine.outputs import CompletionOutput, Logprob, TokenLogprobs

DONE = b"data: [DONE]\n\n"
# JSON has no -inf; OpenAI and vLLM report impossible tokens as -9999.0.
MIN_LOGPROB = -9999.0


# Compact UTF-8 JSON, as json.dumps(ensure_ascii=False, separators=(",", ":")) writes it, in a
# tenth of the time: one event per token per stream is most of the API process's work.
_JSON = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event as OpenAI frames it: a single `data:` line and a blank line."""
    return b"data: " + _JSON.encode(payload) + b"\n\n"


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    draft_tokens: int = 0,
    accepted_tokens: int = 0,
) -> dict[str, Any]:
    """OpenAI's usage object. Its prediction counts are the request's speculation: proposed
    tokens the model accepted, and those it rejected (every proposal verified is one of the
    two)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted_tokens,
            "rejected_prediction_tokens": draft_tokens - accepted_tokens,
        },
    }


def _ranked(step: TokenLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    """The top-`num_top` entries of one token's logprobs, best first."""
    return sorted(
        ((tid, lp) for tid, lp in step.items() if lp.rank <= num_top), key=lambda item: item[1].rank
    )


def _sampled(step: TokenLogprobs, token_id: int) -> Logprob:
    # The engine always includes the sampled token: a missing one is an engine bug; say so clearly.
    if token_id not in step:
        raise KeyError(f"the engine returned no logprob for sampled token {token_id}")
    return step[token_id]


def completion_logprobs(
    token_ids: list[int], steps: list[TokenLogprobs], num_top: int, text_offset: int
) -> tuple[dict[str, Any], int]:
    """Legacy completions logprobs for some tokens; returns the body and the next text offset."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for token_id, step in zip(token_ids, steps, strict=True):
        sampled = _sampled(step, token_id)
        tokens.append(sampled.decoded_token)
        token_logprobs.append(clamp_logprob(sampled.logprob))
        top = {lp.decoded_token: clamp_logprob(lp.logprob) for _, lp in _ranked(step, num_top)}
        top.setdefault(sampled.decoded_token, clamp_logprob(sampled.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(sampled.decoded_token)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return body, text_offset


def _chat_entry(lp: Logprob) -> dict[str, Any]:
    return {
        "token": lp.decoded_token,
        "logprob": clamp_logprob(lp.logprob),
        "bytes": list(lp.decoded_token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(token_ids: list[int], steps: list[TokenLogprobs], num_top: int) -> dict[str, Any]:
    content = []
    for token_id, step in zip(token_ids, steps, strict=True):
        entry = _chat_entry(_sampled(step, token_id))
        entry["top_logprobs"] = [_chat_entry(lp) for _, lp in _ranked(step, num_top)]
        content.append(entry)
    return {"content": content}


@dataclass
class ChoiceCursor:
    """How much of one choice's output a stream has already sent."""

    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: character offset of the next token
    finished: bool = False


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None


def next_delta(cursor: ChoiceCursor, output: CompletionOutput) -> Delta | None:
    """A DELTA output (what is new since the stream's last) counted into the cursor; None when
    it holds nothing new, or the choice has already finished."""
    if cursor.finished:
        return None
    if not output.text and not output.token_ids and output.finish_reason is None:
        return None
    cursor.num_tokens += len(output.token_ids)
    cursor.finished = output.finish_reason is not None
    return Delta(
        output.text, output.token_ids, output.logprobs, output.finish_reason, output.stop_reason
    )


@dataclass(frozen=True)
class ResponseHeader:
    """What every chunk and body of one response repeats."""

    id: str
    created: int
    model: str


def _response_body(
    header: ResponseHeader, kind: str, choices: list[dict[str, Any]], usage_body: dict[str, Any]
) -> dict[str, Any]:
    """A whole response (or a stream's usage chunk): one shape for every object kind."""
    return {
        "id": header.id,
        "object": kind,
        "created": header.created,
        "model": header.model,
        "choices": choices,
        "usage": usage_body,
        "system_fingerprint": None,
    }


def completion_body(
    header: ResponseHeader, choices: list[dict[str, Any]], usage_body: dict[str, Any]
) -> dict[str, Any]:
    return _response_body(header, "text_completion", choices, usage_body)


def completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, output: CompletionOutput
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
    }


def _stream_chunk(
    header: ResponseHeader, kind: str, choices: list[dict[str, Any]], with_usage_field: bool
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": header.id,
        "object": kind,
        "created": header.created,
        "model": header.model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def completion_chunk(
    header: ResponseHeader, choices: list[dict[str, Any]], *, with_usage_field: bool
) -> dict[str, Any]:
    return _stream_chunk(header, "text_completion", choices, with_usage_field)


def chat_body(
    header: ResponseHeader, choices: list[dict[str, Any]], usage_body: dict[str, Any]
) -> dict[str, Any]:
    return _response_body(header, "chat.completion", choices, usage_body)


def chat_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, output: CompletionOutput
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
    }


def chat_chunk(
    header: ResponseHeader, choices: list[dict[str, Any]], *, with_usage_field: bool
) -> dict[str, Any]:
    return _stream_chunk(header, "chat.completion.chunk", choices, with_usage_field)


def chat_chunk_choice(
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def usage_chunk(header: ResponseHeader, obj: str, usage_body: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, just usage."""
    return _response_body(header, obj, [], usage_body)
