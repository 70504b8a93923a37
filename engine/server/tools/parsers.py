"""Tool calls in a model's text, for the formats of the model families we load:

- `hermes` (Qwen2.5, Hermes, SmolLM2, ChatML models): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, one block per call, content before the first block;
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several calls separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`;

and two for forced tool choice, whose text the grammar shapes: `required` (a JSON list of
`{"name", "parameters"}` objects) and `named` (the text is the arguments object itself).

Every parser reads text that may still be growing and returns spans, not values (json_scan.py), so
the stream and the final answer come from the same characters. A malformed call makes the whole
text plain content (nothing is claimed as a call that does not parse); a call cut short by the end
of the text (max_tokens) stays, with its arguments as far as they got.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from kvpilot.contract.engine_choices import TOOL_CALL_PARSERS
from kvpilot.engine.server.tools.json_scan import (
    MalformedJSON,
    ScanMemo,
    object_members,
    skip_ws,
)


@dataclass(frozen=True)
class CallSpan:
    name: str | None  # None until the name's string is complete
    args_start: int | None  # None until the arguments' value begins
    args_end: int | None  # None while the arguments are incomplete

    def arguments(self, text: str) -> str:
        if self.args_start is None:
            return ""
        return text[self.args_start : len(text) if self.args_end is None else self.args_end]

    @property
    def is_complete(self) -> bool:
        return self.name is not None and self.args_end is not None


@dataclass(frozen=True)
class ParsedTools:
    content: str | None  # the message content (in a stream: what may be sent so far)
    calls: list[CallSpan]


class ToolParser(Protocol):
    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedTools:
        """final: the text is complete (no marker can still be growing at its end). memo: a
        stream's scans of this text's earlier, shorter versions (json_scan.ScanMemo)."""
        ...


def _call_at(
    text: str, i: int, args_keys: tuple[str, ...], memo: ScanMemo | None
) -> tuple[CallSpan, int | None]:
    """The call object starting at text[i] and its end (None while incomplete)."""
    members, end = object_members(text, i, memo)
    name = None
    m = members.get("name")
    if m is not None and m.end is not None:
        value = json.loads(text[m.start : m.end])
        if not isinstance(value, str):
            raise MalformedJSON("a tool call's name must be a string")
        name = value
    args = next((members[k] for k in args_keys if k in members), None)
    if end is not None:
        if name is None:
            raise MalformedJSON("a tool call without a name")
        if args is None:
            raise MalformedJSON(f"a tool call without {args_keys[0]}")
        _check_arguments(text, args.start, args.end, memo)
    return CallSpan(
        name, None if args is None else args.start, None if args is None else args.end
    ), end


def _check_arguments(text: str, start: int, end: int, memo: ScanMemo | None) -> None:
    """MalformedJSON unless text[start:end] is a JSON object (each span decoded once per memo)."""
    if memo is not None and (start, end) in memo.checked:
        return
    if not isinstance(json.loads(text[start:end]), dict):
        raise MalformedJSON("a tool call's arguments must be an object")
    if memo is not None:
        memo.checked.add((start, end))


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _calls_in_array(
    text: str, i: int, args_keys: tuple[str, ...], memo: ScanMemo | None
) -> list[CallSpan]:
    """Calls in the JSON list at text[i] (after whitespace)."""
    i = skip_ws(text, i)
    if i >= len(text):
        return []
    if text[i] != "[":
        raise MalformedJSON("expected a list of tool calls")
    calls: list[CallSpan] = []
    j = skip_ws(text, i + 1)
    while j < len(text) and text[j] != "]":
        call, end = _call_at(text, j, args_keys, memo)
        calls.append(call)
        if end is None:
            break
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "]":
            raise MalformedJSON("expected ',' or ']' between tool calls")
    return calls


def _guarded(parse: ToolParserFn, text: str, final: bool, memo: ScanMemo | None) -> ParsedTools:
    if memo is not None:
        memo.attach(text)
    try:
        return parse(text, final, memo)
    except (MalformedJSON, json.JSONDecodeError):
        return ParsedTools(text if final else None, [])


class ToolParserFn(Protocol):
    def __call__(self, text: str, final: bool, memo: ScanMemo | None) -> ParsedTools: ...


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedTools:
        return _guarded(self._parse, text, final, memo)

    def _parse(self, text: str, final: bool, memo: ScanMemo | None) -> ParsedTools:
        first = text.find(self.OPEN)
        if first < 0:
            keep = len(text) if final else len(text) - _held_back(text, self.OPEN)
            return ParsedTools(text[:keep], [])
        calls: list[CallSpan] = []
        at = first
        while at >= 0:
            call, end = _call_at(text, at + len(self.OPEN), ("arguments", "parameters"), memo)
            calls.append(call)
            if end is None:
                break
            at = text.find(self.OPEN, end)
        return ParsedTools(text[:first] or None, calls)


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedTools:
        return _guarded(self._parse, text, final, memo)

    def _parse(self, text: str, final: bool, memo: ScanMemo | None) -> ParsedTools:
        start = skip_ws(text, 0)
        if text.startswith(self.TAG, start):
            start = skip_ws(text, start + len(self.TAG))
        elif not final and self.TAG.startswith(text[start:]):
            return ParsedTools("", [])  # could still become the tag
        if start >= len(text):
            return ParsedTools(text if final else "", [])
        if text[start] != "{":
            return ParsedTools(text, [])
        calls: list[CallSpan] = []
        at: int | None = start
        while at is not None and at < len(text):
            call, end = _call_at(text, at, ("parameters", "arguments"), memo)
            calls.append(call)
            if end is None:
                break
            at = skip_ws(text, end)
            if at < len(text) and text[at] == ";":
                at = skip_ws(text, at + 1)
            elif at < len(text):
                raise MalformedJSON("text after a tool call")
        return ParsedTools(None, calls)


class MistralParser:
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedTools:
        return _guarded(self._parse, text, final, memo)

    def _parse(self, text: str, final: bool, memo: ScanMemo | None) -> ParsedTools:
        at = text.find(self.MARKER)
        if at < 0:
            keep = len(text) if final else len(text) - _held_back(text, self.MARKER)
            return ParsedTools(text[:keep], [])
        calls = _calls_in_array(text, at + len(self.MARKER), ("arguments", "parameters"), memo)
        return ParsedTools(text[:at] or None, calls)


class RequiredParser:
    """tool_choice "required": the grammar makes the text a JSON list of calls."""

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedTools:
        return _guarded(
            lambda t, f, m: ParsedTools(None, _calls_in_array(t, 0, ("parameters",), m)),
            text,
            final,
            memo,
        )


class NamedParser:
    """tool_choice naming a function: the grammar makes the text that function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedTools:
        if memo is not None:
            memo.attach(text)
        start = skip_ws(text, 0)
        if start >= len(text):
            return ParsedTools(None, [CallSpan(self.name, None, None)])
        try:
            members_end = object_members(text, start, memo)[1]
        except MalformedJSON:
            return ParsedTools(text if final else None, [])
        return ParsedTools(None, [CallSpan(self.name, start, members_end)])


def parser_named(name: str) -> ToolParser:
    parsers: dict[str, ToolParser] = {
        "hermes": HermesParser(),
        "llama3_json": Llama3JsonParser(),
        "mistral": MistralParser(),
    }
    if name not in parsers:
        raise ValueError(f"tool parser must be one of {TOOL_CALL_PARSERS}, got {name!r}")
    return parsers[name]


def parser_for_template(chat_template: str | None) -> str:
    """The tool-call format a model's chat template speaks (hermes when it shows none)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3_json"
    return "hermes"
