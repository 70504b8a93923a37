"""Request parsing and mapping onto SamplingParams: pure functions, no server."""

from __future__ import annotations

import json

import pytest

from kvpilot.contract.errors import APIError
from kvpilot.contract.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    num_logprobs,
    parse_request,
    requested_max_tokens,
)
from kvpilot.engine.server.sampling import to_sampling_params
from kvpilot.engine.server.serving import resolve_max_tokens
from kvpilot.engine.server.tools.prompt import template_inputs


def parse_chat(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def parse_completion(**fields: object) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"prompt": "hi", **fields}).encode())


def test_defaults_follow_openai() -> None:
    params = to_sampling_params(parse_chat(), max_tokens=7)
    assert (params.n, params.max_tokens, params.temperature, params.top_p) == (1, 7, 1.0, 1.0)
    assert params.logprobs is None and params.stop == () and params.seed is None


def test_every_sampling_field_reaches_sampling_params() -> None:
    request = parse_chat(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3, stop=["a", "bc"], n=2,
        presence_penalty=0.5, frequency_penalty=-0.5, ignore_eos=True, stop_token_ids=[5],
        include_stop_str_in_output=True, logprobs=True, top_logprobs=4, cache_salt="tenant-a",
    )  # fmt: skip
    params = to_sampling_params(request, max_tokens=9)
    assert params.temperature == 0.5 and params.top_p == 0.9 and params.top_k == 40
    assert params.min_p == 0.05 and params.seed == 3 and params.stop == ("a", "bc")
    assert params.n == 2 and params.presence_penalty == 0.5 and params.frequency_penalty == -0.5
    assert params.ignore_eos and params.stop_token_ids == (5,) and params.include_stop_str_in_output
    assert params.logprobs == 4
    assert request.cache_salt == "tenant-a"


def test_stop_as_a_single_string() -> None:
    assert to_sampling_params(parse_completion(stop="\n"), 4).stop == ("\n",)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert requested_max_tokens(parse_chat(max_tokens=5, max_completion_tokens=3)) == 3
    assert requested_max_tokens(parse_chat(max_tokens=5)) == 5
    assert requested_max_tokens(parse_completion()) is None


def test_logprobs_counts_differ_between_chat_and_completions() -> None:
    assert num_logprobs(parse_chat()) is None
    assert num_logprobs(parse_chat(logprobs=True)) == 0
    assert num_logprobs(parse_chat(logprobs=True, top_logprobs=5)) == 5
    assert num_logprobs(parse_completion(logprobs=0)) == 0
    assert num_logprobs(parse_completion(logprobs=3)) == 3


def test_unknown_fields_are_ignored() -> None:
    assert parse_chat(store=True, metadata={"a": "b"}, some_future_field=1).n == 1


def test_developer_role_becomes_system_and_text_parts_are_joined() -> None:
    request = parse_request(
        ChatCompletionRequest,
        json.dumps(
            {
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
                    {"role": "assistant", "content": None},
                ]
            }
        ).encode(),
    )  # fmt: skip
    messages, tools = template_inputs(request, "{{ messages }}", "hermes")
    assert tools is None
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "0.5"}, "temperature"),  # strict: no string-to-number coercion
        ({"n": True}, "n"),
        ({"n": 0}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": 2.5}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"logit_bias": {"42": "5"}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_bad_chat_fields_name_the_param(fields: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_chat(**fields)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert param in info.value.message or info.value.param == param


def test_bad_json_and_non_object_bodies() -> None:
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(APIError) as info:
            parse_request(CompletionRequest, body)
        assert info.value.status_code == 400


def test_empty_stop_string_is_rejected_by_sampling_params() -> None:
    with pytest.raises(APIError) as info:
        to_sampling_params(parse_completion(stop=[""]), 4)
    assert info.value.param == "stop"


def test_context_length_message_carries_the_numbers() -> None:
    assert resolve_max_tokens(None, 10, 100, what="prompt", param="prompt") == 90
    assert resolve_max_tokens(20, 10, 100, what="prompt", param="prompt") == 20
    with pytest.raises(APIError) as info:
        resolve_max_tokens(95, 10, 100, what="messages", param="messages")
    err = info.value
    assert err.status_code == 400 and err.code == "context_length_exceeded"
    assert "100" in err.message and "105" in err.message and "95" in err.message
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, 100, 100, what="prompt", param="prompt")
    assert info.value.param == "prompt"
