"""Where JSON values start and end in text that may still be growing (a stream).

Only boundaries are found here, not values: a call's arguments are sent as the exact characters
the model wrote, so every streamed fragment is a prefix of the final arguments and the fragments
reassemble to the non-streamed result. Values are checked with json.loads once complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"


class MalformedJSON(ValueError):
    pass


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] is a quote: the index past its closing quote, None if the text ends first."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at text[i] (after whitespace), or None when
    the text ends inside it. MalformedJSON when no value can start there."""
    i = skip_ws(text, i)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    if j == i:
        raise MalformedJSON(f"no JSON value at {text[i : i + 20]!r}")
    # A number or literal running to the end of the text may still grow ("12" -> "123").
    return None if j == len(text) else j


@dataclass(frozen=True)
class Member:
    start: int  # where the value starts
    end: int | None  # past its end; None while incomplete


def object_members(text: str, i: int) -> tuple[dict[str, Member], int | None]:
    """The members of the object at text[i] (after whitespace) found so far, and the object's end
    (None while incomplete). MalformedJSON when it is not an object."""
    i = skip_ws(text, i)
    if i >= len(text):
        return {}, None
    if text[i] != "{":
        raise MalformedJSON(f"expected an object at {text[i : i + 20]!r}")
    members: dict[str, Member] = {}
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            raise MalformedJSON(f"expected a key at {text[j : j + 20]!r}")
        key_end = _string_end(text, j)
        if key_end is None:
            return members, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return members, None
        if text[j] != ":":
            raise MalformedJSON(f"expected ':' after {key!r}")
        start = skip_ws(text, j + 1)
        if start >= len(text):
            return members, None
        end = value_end(text, start)
        members[key] = Member(start, end)
        if end is None:
            return members, None
        j = skip_ws(text, end)
    return members, None
