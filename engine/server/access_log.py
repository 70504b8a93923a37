"""One log line per HTTP request: method, path, status and milliseconds, when its response ended
(a stream's last byte included). Never the query string, the headers or a body: they carry API
keys and prompts. Probes and scrapes (/health, /ready, /metrics; polled up to every 50 ms) are
logged at DEBUG only, so that they do not drown the requests."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("kvpilot.access")
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})


class AccessLogMiddleware:
    """Plain ASGI (no BaseHTTPMiddleware): streams and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        # 500: the app raised before it answered (the server's error handler answers so).
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path: str = scope["path"]
            level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
            access_logger.log(
                level,
                "%s %s %d %.1f ms",
                scope["method"],
                path,
                status,
                (time.perf_counter() - started) * 1000,
            )
