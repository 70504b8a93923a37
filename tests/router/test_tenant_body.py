"""What the router sets on a tenant's forwarded body, and what it reads back from the response:
fields that win over the client's own, usage counted as a stream passes and settled from the
engine's usage chunk (dropped for clients that did not ask for it), shared prefixes by token."""

from __future__ import annotations

import json

import pytest

from kvpilot.contract.openai import ChatCompletionRequest, CompletionRequest, parse_request
from kvpilot.router.forwarded_body import with_fields
from kvpilot.router.shared_prefix import shared_tokens
from kvpilot.router.usage_meter import StreamMeter, body_usage


def test_fields_win_over_the_clients_and_keep_the_rest() -> None:
    body = b'{"model": "m", "prompt": "hi", "priority": -100, "cache_salt": "mine"}  \n'
    out = with_fields(body, {"priority": 1, "cache_salt": "tenant:t/a:mine"})
    request = parse_request(CompletionRequest, out)
    assert request.priority == 1 and request.cache_salt == "tenant:t/a:mine"
    assert request.prompt == "hi" and request.model == "m"
    assert with_fields(b"{}", {"a": [1, "x"]}) == b'{"a":[1,"x"]}'
    assert with_fields(body, {}) is body
    with pytest.raises(ValueError):
        with_fields(b"[1]", {"a": 1})


def test_stream_options_are_forced_and_the_usage_chunk_dropped_unless_asked() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}'
    out = with_fields(body, {"stream_options": {"include_usage": True}})
    assert parse_request(ChatCompletionRequest, out).include_usage

    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    events = [
        event({"choices": [{"index": 0, "delta": {"role": "assistant"}}], "usage": None}),
        event({"choices": [{"index": 0, "delta": {"content": "He"}}], "usage": None}),
        event({"choices": [{"index": 0, "delta": {"content": "llo"}}], "usage": None}),
        event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}),
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    for wants_usage in (False, True):
        meter = StreamMeter(client_wants_usage=wants_usage)
        # Split anywhere: events are passed whole, in order.
        passed = b"".join(meter.feed(stream[i : i + 7]) for i in range(0, len(stream), 7))
        passed += meter.flush()
        expected = events if wants_usage else events[:3] + events[4:]
        assert passed == b"".join(expected)
        assert meter.counted_tokens == 2
        assert meter.usage is not None and meter.usage.completion_tokens == 2
        assert meter.usage.prompt_tokens == 7


def test_completion_streams_count_text_per_choice_and_bodies_carry_usage() -> None:
    meter = StreamMeter(client_wants_usage=False)
    texts = ["a", "b", ""]
    chunk = {"choices": [{"index": i, "text": t} for i, t in enumerate(texts)]}
    meter.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert meter.counted_tokens == 2 and meter.usage is None
    usage = body_usage(b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}')
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 9)
    assert body_usage(b'{"error": {"message": "no"}}') is None
    assert body_usage(b"not json") is None


def test_shared_tokens_is_the_longest_exact_prefix() -> None:
    prefixes = ((1, 2, 3, 4, 5), (1, 2, 3))
    assert shared_tokens([1, 2, 3, 4, 5, 6], prefixes) == 5
    assert shared_tokens([1, 2, 3, 9], prefixes) == 3
    assert shared_tokens([1, 2], prefixes) == 0
    assert shared_tokens(None, prefixes) == 0
