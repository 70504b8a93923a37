"""Structured outputs and tool calling through real uvicorn, the official openai client and the
bundled SmolLM2 (real weights): every constrained completion must parse and validate, streamed or
not, and forced tool calls must carry arguments valid under their function's schema.

max_tokens stays small and the schemas bound their strings and lists, so that every completion
can finish inside it (a completion cut by max_tokens is checked to say `length`, never `stop`).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvpilot.engine.server.inprocess import InProcessServer

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_arrays_enums_bounds": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "temperature": {"type": "number", "minimum": -40, "maximum": 50},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "day": {"enum": ["mon", "tue", "wed"]},
                        "rain": {"type": "boolean"},
                    },
                    "required": ["day", "rain"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["city", "temperature", "unit", "days"],
        "additionalProperties": False,
    },
    "integers_and_optional": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "nickname": {"type": "string", "maxLength": 8},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}
PROMPT = [{"role": "user", "content": "Describe the weather in Paris as JSON."}]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 12}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=180)


def _json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def _stream_text(chunks: list[Any]) -> tuple[str, str | None]:
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return text, finish[0] if finish else None


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_streamed_and_not(
    client: openai.OpenAI, model_name: str, name: str
) -> None:
    schema = SCHEMAS[name]
    full = client.chat.completions.create(
        model=model_name,
        messages=PROMPT,
        response_format=_json_schema_format(schema),  # type: ignore[arg-type]
        max_tokens=96,
        temperature=0.9,
        seed=7,
        n=2,
    )
    assert len(full.choices) == 2
    for choice in full.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=PROMPT,
            response_format=_json_schema_format(schema),  # type: ignore[arg-type]
            max_tokens=96,
            temperature=0.9,
            seed=7,
            stream=True,
        )
    )
    text, finish = _stream_text(chunks)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)
    # Seeded: the stream's one choice is the first choice of the same request unstreamed.
    assert text == full.choices[0].message.content


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "artist", "doctor"]


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model_name: str) -> None:
    completion = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person,
        max_tokens=64,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert Person.model_validate_json(completion.choices[0].message.content or "") == parsed


def test_json_object_and_vllm_guided_json(client: openai.OpenAI, model_name: str) -> None:
    obj = client.chat.completions.create(
        model=model_name,
        messages=PROMPT,
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: said so, never claimed complete
        assert obj.choices[0].finish_reason == "length"
    schema = SCHEMAS["integers_and_optional"]
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        out = client.completions.create(
            model=model_name,
            prompt="A person as JSON:",
            max_tokens=48,
            temperature=0,
            extra_body=extra,
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].text), schema)


def test_regex_and_choice_hold(client: openai.OpenAI, model_name: str) -> None:
    pattern = r"\d{3}-[A-Z]{2}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        out = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Give me a code."}],
            max_tokens=12,
            temperature=1.0,
            n=3,
            seed=3,
            extra_body=extra,
        )
        import re

        for choice in out.choices:
            assert re.fullmatch(pattern, choice.message.content or ""), choice.message.content
            assert choice.finish_reason == "stop"
    choices = ["red", "green", "blue or cyan"]
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Pick a color."}],
        max_tokens=8,
        temperature=1.0,
        n=4,
        seed=5,
        extra_body={"guided_choice": choices},
    )
    assert all(c.message.content in choices for c in out.choices)
    text, finish = _stream_text(
        list(
            client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": "Pick a color."}],
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_body={"structured_outputs": {"choice": choices}},
            )
        )
    )
    assert text in choices and finish == "stop"


def test_grammar_and_stop_strings(client: openai.OpenAI, model_name: str) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe so"'
    out = client.completions.create(
        model=model_name,
        prompt="Answer:",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_grammar": grammar},
    )
    assert out.choices[0].text in ("yes", "no", "maybe so")
    cut = client.completions.create(
        model=model_name,
        prompt="A code:",
        max_tokens=12,
        temperature=0,
        stop=["-"],
        extra_body={"guided_regex": r"\d{3}-\d{3}"},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert len(cut.choices[0].text) == 3 and cut.choices[0].text.isdigit()


def test_a_constraint_cut_by_max_tokens_ends_with_length(
    client: openai.OpenAI, model_name: str
) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=PROMPT,
        response_format=_json_schema_format(SCHEMAS["nested_arrays_enums_bounds"]),  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.choices[0].message.content or "")


def test_logprobs_are_of_the_masked_distribution(client: openai.OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Pick a color."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"guided_choice": ["red", "green"]},
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    first = content[0]
    # Greedy under the mask: the chosen token is the best allowed one...
    assert first.top_logprobs[0].token == first.token
    # ...and only tokens that can start "red" or "green" have any probability.
    alive = [t for t in first.top_logprobs if t.logprob > -9999.0]
    assert alive and all(("red".startswith(t.token) or "green".startswith(t.token)) for t in alive)


def test_constrained_and_free_requests_share_a_batch(
    client: openai.OpenAI, model_name: str
) -> None:
    free_prompt = [{"role": "user", "content": "Name three colors."}]
    alone = client.chat.completions.create(
        model=model_name, messages=free_prompt, max_tokens=24, temperature=0
    )
    results: dict[str, Any] = {}

    def run(key: str, **kwargs: Any) -> None:
        results[key] = client.chat.completions.create(model=model_name, temperature=0, **kwargs)

    schema = SCHEMAS["integers_and_optional"]
    threads = [
        threading.Thread(
            target=run, args=("free",), kwargs={"messages": free_prompt, "max_tokens": 24}
        ),
        *(
            threading.Thread(
                target=run,
                args=(f"json{i}",),
                kwargs={
                    "messages": [{"role": "user", "content": f"Person number {i} as JSON."}],
                    "max_tokens": 48,
                    "response_format": _json_schema_format(schema),
                },
            )
            for i in range(3)
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    # The free request's greedy text is what it was alone: no mask leaked into its row.
    assert results["free"].choices[0].message.content == alone.choices[0].message.content
    for i in range(3):
        jsonschema.validate(json.loads(results[f"json{i}"].choices[0].message.content), schema)
    # The same constrained prompt again: served from the prefix cache, same greedy answer.
    again = client.chat.completions.create(
        model=model_name,
        temperature=0,
        messages=[{"role": "user", "content": "Person number 0 as JSON."}],
        max_tokens=48,
        response_format=_json_schema_format(schema),  # type: ignore[arg-type]
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == results["json0"].choices[0].message.content


# ---- tool calling ------------------------------------------------------------------------------


def _check_calls(message: Any, allowed: set[str]) -> list[tuple[str, str]]:
    assert message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
        calls.append((call.function.name, call.function.arguments))
    return calls


def _reassemble(chunks: list[Any]) -> tuple[list[tuple[str, str]], str | None]:
    by_index: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call opens with its id and name, arguments after
                assert delta.index not in names and delta.function.name
                names[delta.index] = delta.function.name
                by_index[delta.index] = []
            by_index[delta.index].append(delta.function.arguments or "")
    return [(names[i], "".join(by_index[i])) for i in sorted(names)], finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_are_valid_and_stream_the_same(
    client: openai.OpenAI, model_name: str, tool_choice: Any
) -> None:
    allowed = {"get_time"} if isinstance(tool_choice, dict) else set(TOOL_SCHEMAS)
    kwargs: dict[str, Any] = {
        "model": model_name,
        "messages": TOOL_PROMPT,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 80,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = _check_calls(choice.message, allowed)
    streamed, finish = _reassemble(list(client.chat.completions.create(stream=True, **kwargs)))
    assert finish == "tool_calls"
    assert streamed == calls


def test_tool_choice_required_without_parallel_calls_makes_one(
    client: openai.OpenAI, model_name: str
) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=TOOL_PROMPT,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.8,
        seed=11,
        n=2,
    )
    for choice in out.choices:
        assert len(_check_calls(choice.message, set(TOOL_SCHEMAS))) == 1


def test_tool_results_come_back_and_auto_answers(client: openai.OpenAI, model_name: str) -> None:
    messages: list[dict[str, Any]] = [
        *TOOL_PROMPT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(
        model=model_name,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="auto",
        max_tokens=24,
        temperature=0,
    )
    choice = out.choices[0]
    # Auto: whatever the model says is either text or calls that parse.
    if choice.message.tool_calls:
        _check_calls(choice.message, set(TOOL_SCHEMAS))
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "zero"}},
                }
            },
            "response_format",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}
                ]
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_constraints_get_400_naming_the_parameter(
    server: InProcessServer, model_name: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model_name, "messages": PROMPT, "max_tokens": 4, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
