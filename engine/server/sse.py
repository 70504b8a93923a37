"""A Server-Sent Events response that notices a vanished client at once and always cleans up.

Starlette's StreamingResponse only notices a disconnect when its next write fails (ASGI spec 2.4),
and a generator that was never started does not run its `finally` on close. A stream here instead
races the writer against `http.disconnect`, then always calls `on_close` (which aborts the engine
requests), so a client that goes away frees its KV blocks within one engine step, even during a
long prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("kvpilot.server")
T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone (call only after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        # X-Accel-Buffering: proxies such as nginx must not buffer a token stream.
        self.init_headers(
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        )

    async def _pump(self, send: Send) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            pump = asyncio.ensure_future(self._pump(send))
            watcher = asyncio.ensure_future(wait_for_disconnect(receive))
            try:
                await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, watcher):
                    task.cancel()
                await asyncio.gather(pump, watcher, return_exceptions=True)
            if pump.done() and not pump.cancelled():
                exc = pump.exception()
                if exc is not None and not isinstance(exc, OSError | ClientDisconnect):
                    logger.error("stream failed", exc_info=exc)
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
            self.on_close()
