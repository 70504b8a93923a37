"""Where JSON values start and end in text that may still be growing (a stream).

Only boundaries are found here, not values: a call's arguments are sent as the exact characters
the model wrote, so every streamed fragment is a prefix of the final arguments and the fragments
reassemble to the non-streamed result. Values are checked with json.loads once complete.

A stream's text only grows, so a `ScanMemo` keeps where each string or container scan stopped
and the next parse reads only the characters added since: without it, re-reading a call's whole
arguments at every token made a long call (a file written through a tool) quadratic.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = " \t\n\r"
# The next character a scan must look at, found in one C call: inside a string a quote or
# backslash, outside a quote or bracket.
_IN_STRING_STOP = re.compile(r'["\\]')
_OUTSIDE_STOP = re.compile(r'["{}\[\]]')


class MalformedJSON(ValueError):
    pass


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


@dataclass
class _Scan:
    """How far the scan of one string or container has read."""

    pos: int  # the next character to read
    depth: int = 0
    in_string: bool = False
    escaped: bool = False  # the character before pos is a backslash inside a string
    end: int | None = None  # past the value, once read whole


@dataclass
class ScanMemo:
    """Scans of one growing text, by the index where their value starts. `attach` each new text
    first: a text that does not extend the last one forgets every scan."""

    text: str = ""
    scans: dict[int, _Scan] = field(default_factory=dict)
    checked: set[tuple[int, int]] = field(default_factory=set)  # spans json.loads accepted

    def attach(self, text: str) -> None:
        if not text.startswith(self.text):
            self.scans.clear()
            self.checked.clear()
        self.text = text


def _scan_end(text: str, i: int, memo: ScanMemo | None) -> int | None:
    """text[i] opens a string or container: the index past its end, None if the text ends first."""
    scan = None if memo is None else memo.scans.get(i)
    if scan is None:
        scan = _Scan(i)
        if memo is not None:
            memo.scans[i] = scan
    elif scan.end is not None:
        return scan.end
    pos, depth, in_string, escaped = scan.pos, scan.depth, scan.in_string, scan.escaped
    n = len(text)
    while pos < n:
        if escaped:
            escaped = False
            pos += 1
            continue
        found = (_IN_STRING_STOP if in_string else _OUTSIDE_STOP).search(text, pos)
        if found is None:
            pos = n
            break
        c = found.group()
        pos = found.end()
        if c == "\\":
            escaped = True
        elif c == '"':
            in_string = not in_string
            if not in_string and depth == 0:  # a string value's closing quote
                scan.end = pos
                return pos
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                scan.end = pos
                return pos
    scan.pos, scan.depth, scan.in_string, scan.escaped = pos, depth, in_string, escaped
    return None


def value_end(text: str, i: int, memo: ScanMemo | None = None) -> int | None:
    """The end (exclusive) of the JSON value starting at text[i] (after whitespace), or None when
    the text ends inside it. MalformedJSON when no value can start there."""
    i = skip_ws(text, i)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"' or c in "{[":
        return _scan_end(text, i, memo)
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


def object_members(
    text: str, i: int, memo: ScanMemo | None = None
) -> tuple[dict[str, Member], int | None]:
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
        key_end = _scan_end(text, j, memo)
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
        end = value_end(text, start, memo)
        members[key] = Member(start, end)
        if end is None:
            return members, None
        j = skip_ws(text, end)
    return members, None
