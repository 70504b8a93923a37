"""What a response used, read as it passes through the router: completion tokens counted as a
stream goes (charged to the tenant's quota while it streams) and the engine's exact `usage` at the
end (what settles it).

A tenant's streams are forwarded with `stream_options.include_usage` set (router.forwarded_body),
so every stream ends with the engine's usage chunk; it is passed on only to clients that asked
for it. The stream is relayed in whole Server-Sent Events (an event is never split, so none is
held back longer than the bytes that complete it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_EVENT_END = b"\n\n"
_DATA = b"data: "


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


def usage_of(payload: dict[str, Any]) -> Usage | None:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion)


def body_usage(content: bytes) -> Usage | None:
    """The usage of a whole (non-stream) response body; None for an error or other body."""
    try:
        payload = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return None
    return usage_of(payload) if isinstance(payload, dict) else None


@dataclass
class StreamMeter:
    """Feeds on a stream's bytes; `feed` returns what to pass on."""

    client_wants_usage: bool
    counted_tokens: int = 0  # completion tokens seen so far (a choice's delta with output)
    usage: Usage | None = None  # the engine's, from its usage chunk
    _pending: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> bytes:
        self._pending += chunk
        end = self._pending.rfind(_EVENT_END)
        if end < 0:
            return b""
        complete = bytes(self._pending[: end + len(_EVENT_END)])
        del self._pending[: end + len(_EVENT_END)]
        passed = [event for event in complete.split(_EVENT_END)[:-1] if self._keep(event)]
        return b"".join(event + _EVENT_END for event in passed)

    def flush(self) -> bytes:
        """What is left when the stream ends (bytes not ending an event: passed as they are)."""
        rest = bytes(self._pending)
        self._pending.clear()
        return rest

    def _keep(self, event: bytes) -> bool:
        if not event.startswith(_DATA + b"{"):
            return True
        try:
            payload = json.loads(event[len(_DATA) :])
        except (ValueError, UnicodeDecodeError):
            return True
        choices = payload.get("choices")
        if not choices:
            usage = usage_of(payload)
            if usage is not None:
                self.usage = usage
                return self.client_wants_usage
            return True
        for choice in choices:
            if _has_output(choice):
                self.counted_tokens += 1
        return True


def _has_output(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))
