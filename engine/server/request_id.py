"""Every HTTP request gets an id: in the `x-request-id` response header, in the log line of any
server fault, and in a 5xx body's message, so that a client's report leads to the log."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def request_id_of(request: Request) -> str:
    """The id the middleware gave this request (a fresh one if it never passed through it)."""
    state: dict[str, Any] = request.scope.setdefault("state", {})
    return state.setdefault("request_id", new_request_id())


class RequestIdMiddleware:
    """Plain ASGI (no BaseHTTPMiddleware): streams and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # In place: the scope's state dict is the one outer layers (the 500 handler) see too.
        request_id = scope.setdefault("state", {}).setdefault("request_id", new_request_id())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == HEADER.encode() for k, _ in headers):
                    headers.append((HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
