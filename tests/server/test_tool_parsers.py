"""Tool-call parsers on model outputs in each family's format (the shapes Llama 3.x, Hermes /
Qwen2.5 and Mistral instruct models emit, quirks included), malformed and cut-short ones too; and
the stream: fed piece by piece, the deltas reassemble to exactly the non-streamed message."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpilot.engine.server.tools.json_scan import (
    MalformedJSON,
    ScanMemo,
    object_members,
    value_end,
)
from kvpilot.engine.server.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolParser,
    parser_for_template,
    parser_named,
)
from kvpilot.engine.server.tools.render import (
    ToolStreamCursor,
    parse_final,
    tool_deltas,
    tool_message,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
W_ARGS = '{"city": "Paris", "unit": "celsius"}'

# (parser, model output, expected content, expected [(name, arguments object)])
CASES: list[tuple[str, ToolParser, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (
        "hermes-one",
        HermesParser(),
        f'<tool_call>\n{{"name": "get_weather", "arguments": {W_ARGS}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "hermes-text-then-two",
        HermesParser(),
        "Let me check.\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {W_ARGS}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (
        "hermes-no-call",
        HermesParser(),
        "The weather in Paris is sunny.",
        "The weather in Paris is sunny.",
        [],
    ),
    (
        "hermes-escaped-braces-in-strings",
        HermesParser(),
        '<tool_call>{"name": "echo", "arguments": {"text": "a } b \\" { c"}}</tool_call>',
        None,
        [("echo", {"text": 'a } b " { c'})],
    ),
    (
        "hermes-malformed",
        HermesParser(),
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",, }}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",, }}\n</tool_call>',
        [],
    ),
    (
        "hermes-no-name",
        HermesParser(),
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
        [],
    ),
    (
        "llama3-parameters",
        Llama3JsonParser(),
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3-python-tag-and-two",
        Llama3JsonParser(),
        f'<|python_tag|>{{"name": "get_weather", "parameters": {W_ARGS}}}; '
        '{"name": "get_time", "parameters": {"tz": "UTC"}}',
        None,
        [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    (
        "llama3-plain-text",
        Llama3JsonParser(),
        "It is sunny in Paris.",
        "It is sunny in Paris.",
        [],
    ),
    (
        "llama3-arguments-not-object",
        Llama3JsonParser(),
        '{"name": "get_weather", "parameters": "Paris"}',
        '{"name": "get_weather", "parameters": "Paris"}',
        [],
    ),
    (
        "mistral-list",
        MistralParser(),
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        None,
        [("get_weather", WEATHER), ("get_time", {"tz": "CET"})],
    ),
    (
        "mistral-no-marker",
        MistralParser(),
        "Sure, it is 20 degrees.",
        "Sure, it is 20 degrees.",
        [],
    ),
    (
        "mistral-malformed",
        MistralParser(),
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"} "x"]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"} "x"]',
        [],
    ),
    (
        "required-list",
        RequiredParser(),
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "named",
        NamedParser("get_weather"),
        '{"city": "Paris", "unit": "celsius"}',
        None,
        [("get_weather", WEATHER)],
    ),
]


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_parsers_on_model_outputs(
    parser: ToolParser, text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    parsed = parse_final(parser, text, None)
    assert parsed.content == content
    got = [(c.name, json.loads(c.arguments(text))) for c in parsed.calls]
    assert got == calls
    message = tool_message(parsed, text)
    assert message["content"] == (content or None)
    assert [tc["function"]["name"] for tc in message.get("tool_calls", [])] == [n for n, _ in calls]


def _stream(parser: ToolParser, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    cursor = ToolStreamCursor()
    content = ""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    cuts = [*range(step, len(text), step), len(text)]
    for end in cuts:
        deltas, _ = tool_deltas(cursor, parser, text[:end], final=end == len(text), max_calls=None)
        for delta in deltas:
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] not in names  # id and name come once, first
                    names[call["index"]] = call["function"]["name"]
                    args[call["index"]] = ""
                args[call["index"]] += call["function"]["arguments"]
    return content, [(names[i], args[i]) for i in sorted(names)]


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize(
    ("parser", "text"),
    [(c[1], c[2]) for c in CASES if c[4]],
    ids=[c[0] for c in CASES if c[4]],
)
def test_streamed_deltas_reassemble_to_the_final_message(
    parser: ToolParser, text: str, step: int
) -> None:
    final = parse_final(parser, text, None)
    content, calls = _stream(parser, text, step)
    assert content == (final.content or "")
    assert calls == [(c.name, c.arguments(text)) for c in final.calls]


def test_a_call_cut_short_keeps_its_partial_arguments() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    parsed = parse_final(HermesParser(), text, None)
    assert [(c.name, c.arguments(text), c.is_complete) for c in parsed.calls] == [
        ("get_weather", '{"city": "Par', False)
    ]


def test_a_partial_marker_is_held_back_from_streamed_content() -> None:
    parser = HermesParser()
    assert parser.parse("Checking <tool_", final=False).content == "Checking "
    assert parser.parse("Checking <tool_", final=True).content == "Checking <tool_"
    assert MistralParser().parse("ok [TOOL", final=False).content == "ok "
    assert Llama3JsonParser().parse("<|python", final=False).content == ""


def test_max_calls_keeps_the_first() -> None:
    text = CASES[1][2]
    parsed = parse_final(HermesParser(), text, 1)
    assert [c.name for c in parsed.calls] == ["get_weather"]


def test_json_scan_boundaries() -> None:
    assert value_end('{"a": [1, "]"]} tail', 0) == 15
    assert value_end('"x\\"y" ', 0) == 6
    assert value_end("12", 0) is None  # a number at the end may still grow
    assert value_end("12,", 0) == 2
    assert value_end('{"a": "b', 0) is None
    with pytest.raises(MalformedJSON):
        value_end(",", 0)
    members, end = object_members('{"a": 1, "b": {"c": 2}}', 0)
    assert end == 23 and set(members) == {"a", "b"} and members["b"].end == 22
    members, end = object_members('{"a": 1, "b": {"c"', 0)
    assert end is None and members["b"].end is None


def test_parser_choice_from_the_template() -> None:
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|start_header_id|>{{ tools }}") == "llama3_json"
    assert parser_for_template("<|im_start|>{{ message }}") == "hermes"
    assert parser_for_template(None) == "hermes"
    with pytest.raises(ValueError, match="tool parser"):
        parser_named("pythonic")


# Texts whose scans stop at every awkward place when fed one character at a time: right after a
# backslash, between an escaped backslash and a quote, inside brackets within strings, in nested
# objects, in a second call after a complete first one.
TRICKY_ARGS = {
    "path": 'a "quoted" \\ path\\',
    "code": 'if x:\n    print("{[}]", "\\\\\\"")\n',
    "nested": {"list": [1, {"k": "v}"}, "]"], "empty": {}},
    "unicode": "caf\u00e9 \u2603",
}
MEMO_TEXTS: list[tuple[str, ToolParser, str]] = [
    (
        "hermes-two-tricky",
        HermesParser(),
        "Writing it.\n<tool_call>\n"
        + json.dumps({"name": "write", "arguments": TRICKY_ARGS})
        + "\n</tool_call>\n<tool_call>"
        + json.dumps({"name": "again", "arguments": {"s": "\\\\"}})
        + "</tool_call>",
    ),
    (
        "llama3-two",
        Llama3JsonParser(),
        json.dumps({"name": "a", "parameters": TRICKY_ARGS})
        + "; "
        + json.dumps({"name": "b", "parameters": {}}),
    ),
    (
        "mistral-list",
        MistralParser(),
        "[TOOL_CALLS] "
        + json.dumps(
            [{"name": "a", "arguments": TRICKY_ARGS}, {"name": "b", "arguments": {"x": 1}}]
        ),
    ),
    ("required", RequiredParser(), json.dumps([{"name": "a", "parameters": TRICKY_ARGS}])),
    ("named", NamedParser("write"), json.dumps(TRICKY_ARGS)),
    (
        "hermes-malformed",
        HermesParser(),
        '<tool_call>{"name": "a", "arguments": [1, "\\"]"]}</tool_call>',
    ),
]


@pytest.mark.parametrize(
    ("parser", "text"), [c[1:] for c in MEMO_TEXTS], ids=[c[0] for c in MEMO_TEXTS]
)
def test_a_stream_memo_parses_every_prefix_as_a_fresh_parse_does(
    parser: ToolParser, text: str
) -> None:
    """The memo resumes each scan where the last, shorter text stopped; every prefix, final or
    not, must parse exactly as the same text parsed from scratch."""
    memo = ScanMemo()
    for end in range(len(text) + 1):
        final = end == len(text)
        assert parser.parse(text[:end], final, memo) == parser.parse(text[:end], final), end


def test_a_memo_given_a_text_that_does_not_extend_the_last_forgets_its_scans() -> None:
    parser, memo = HermesParser(), ScanMemo()
    # first stops right after a backslash inside a string: read on by a stale scan, other's
    # closing quote would count as escaped.
    first = '<tool_call>{"name": "a", "arguments": {"s": "x\\'
    other = '<tool_call>{"name": "a", "arguments": {"s": "y"}, "z": 1}</tool_call>'
    parser.parse(first, False, memo)
    assert parser.parse(other, True, memo) == parser.parse(other, True)
    assert [c.arguments(other) for c in parser.parse(other, True, memo).calls] == ['{"s": "y"}']


def test_json_scan_resumes_inside_strings_and_escapes() -> None:
    text = '{"a": "x\\\\", "b": ["\\"]", {"c": "}"}]} tail'
    end = text.index(" tail")
    for cut in range(len(text) + 1):
        memo = ScanMemo()
        memo.attach(text[:cut])
        first = value_end(text[:cut], 0, memo)
        memo.attach(text)
        assert value_end(text, 0, memo) == end, cut
        assert first == (end if cut >= end else None), cut
