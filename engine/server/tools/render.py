"""Tool calls into OpenAI's shapes: the message of a finished choice, and a stream's deltas (id and
name first, then argument fragments), both built from the same parsed spans of the same text."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.server.tools.json_scan import ScanMemo
from kvpilot.engine.server.tools.parsers import ParsedTools, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(parsed: ParsedTools, engine_reason: str | None) -> str | None:
    """OpenAI's `tool_calls` for a choice that ended by itself with calls; `length` stays."""
    return "tool_calls" if parsed.calls and engine_reason == "stop" else engine_reason


def parse_final(
    parser: ToolParser, text: str, max_calls: int | None, memo: ScanMemo | None = None
) -> ParsedTools:
    parsed = parser.parse(text, final=True, memo=memo)
    if max_calls is not None and len(parsed.calls) > max_calls:
        parsed = ParsedTools(parsed.content, parsed.calls[:max_calls])
    return parsed


def tool_message(parsed: ParsedTools, text: str) -> dict[str, Any]:
    """A finished choice's message: content (null when empty) and its tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    if parsed.calls:
        message["tool_calls"] = [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": call.name or "", "arguments": call.arguments(text)},
            }
            for call in parsed.calls
        ]
    return message


@dataclass
class ToolStreamCursor:
    """What one choice's stream has sent: content characters, and per call its id and how many
    argument characters; and where the parser's scans of the text so far stopped."""

    num_content_chars: int = 0
    ids: list[str] = field(default_factory=list)
    num_args_chars: list[int] = field(default_factory=list)
    memo: ScanMemo = field(default_factory=ScanMemo)


def tool_deltas(
    cursor: ToolStreamCursor,
    parser: ToolParser,
    text: str,
    *,
    final: bool,
    max_calls: int | None,
) -> tuple[list[dict[str, Any]], ParsedTools]:
    """The deltas the cumulative text adds since the cursor (advancing it), and the parse."""
    if final:
        parsed = parse_final(parser, text, max_calls, cursor.memo)
    else:
        parsed = parser.parse(text, final=False, memo=cursor.memo)
    calls = parsed.calls if max_calls is None else parsed.calls[:max_calls]
    deltas: list[dict[str, Any]] = []
    content = parsed.content or ""
    if len(content) > cursor.num_content_chars and not cursor.ids:
        deltas.append({"content": content[cursor.num_content_chars :]})
        cursor.num_content_chars = len(content)
    for k, call in enumerate(calls):
        if k == len(cursor.ids):
            if call.name is None:
                break
            cursor.ids.append(new_call_id())
            cursor.num_args_chars.append(0)
            head = {"name": call.name, "arguments": ""}
            deltas.append(
                {
                    "tool_calls": [
                        {"index": k, "id": cursor.ids[k], "type": "function", "function": head}
                    ]
                }
            )
        arguments = call.arguments(text)
        if len(arguments) > cursor.num_args_chars[k]:
            fragment = arguments[cursor.num_args_chars[k] :]
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": fragment}}]})
            cursor.num_args_chars[k] = len(arguments)
    return deltas, parsed
