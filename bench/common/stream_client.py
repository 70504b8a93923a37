"""A lean HTTP/1.1 client for streamed (Server-Sent Events) POSTs: the load generator's hot path.

On the 2-core machine the load generator shares the cores with the server it measures, and every
CPU second it spends is taken from the server's engine (bench/RESULTS.md, "Where serving loses
against offline"). aiohttp's streamed response wakes a reader task per chunk and splits lines in
a Python iterator; here each connection is an asyncio.Protocol that hands what arrives to
httptools (uvicorn's own C parser: status, headers, chunked transfer coding), splits the events
in its body callback and passes each event's data to the caller with the arrival time, with no
task switch per chunk. Connections are kept alive and reused, as aiohttp's pool does.

Only what the benchmark needs: POST with a JSON body, `data:` events separated by a blank line
(the OpenAI streaming format both servers write), the whole body of a non-200 answer.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Callable

import httptools

# An event's `data:` payload (bytes, without the prefix) and the time its bytes arrived.
EventHandler = Callable[[bytes, float], None]


class StreamError(Exception):
    """The connection failed or closed before the response was complete."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_read = time.monotonic()
        self._parser = httptools.HttpResponseParser(self)
        self._done: asyncio.Future[None] | None = None
        self._now = 0.0
        self._begin_response(None)

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._now = time.perf_counter()
        self.last_read = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(StreamError(f"bad HTTP response: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(StreamError(f"connection closed mid-response: {exc!r}"))

    # -- httptools callbacks -----------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body += body
            return
        data = self._pending + body if self._pending else body
        start = 0
        while (end := data.find(b"\n\n", start)) >= 0:
            self._event(data[start:end])
            start = end + 2
        self._pending = data[start:]

    def on_message_complete(self) -> None:
        self.keep_alive = self._parser.should_keep_alive()
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    # -- internals ---------------------------------------------------------------------------
    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if line.startswith(b"data:") and self._on_event is not None:
                self._on_event(line[5:].lstrip(b" ").rstrip(b"\r"), self._now)

    def _fail(self, exc: Exception) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    def _begin_response(self, on_event: EventHandler | None) -> None:
        """The state of one response, fresh for each request on the connection."""
        self._on_event = on_event
        self._pending = b""
        self.status = 0
        self.error_body = b""
        self.keep_alive = False

    def start(self, request: bytes, on_event: EventHandler) -> asyncio.Future[None]:
        assert self.transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self._begin_response(on_event)
        self.transport.write(request)
        return self._done


class StreamClient:
    """Streamed POSTs to one server (`base_url`), over a pool of keep-alive connections."""

    def __init__(self, base_url: str, read_timeout_s: float = 600.0) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http" or url.hostname is None:
            raise ValueError(f"StreamClient speaks plain http only, not {base_url!r}")
        self.host = url.hostname
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/")
        self.read_timeout_s = read_timeout_s
        self._idle: list[_Connection] = []

    async def post(
        self,
        path: str,
        body: bytes,
        on_event: EventHandler,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """POST `body` (JSON) to `path`, calling on_event for each event of a 200 answer; `headers`
        are sent besides the request's own (e.g. Authorization).
        Returns the status and, when it is not 200, the answer's body. Raises StreamError (or
        OSError) when the connection fails, TimeoutError after read_timeout_s without a byte."""
        conn = await self._connection()
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
            + "\r\n"
        )
        done = conn.start(head.encode("latin-1") + body, on_event)
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(done), self.read_timeout_s)
                    break
                except TimeoutError:
                    if time.monotonic() - conn.last_read >= self.read_timeout_s:
                        raise
        except BaseException:
            done.cancel()  # (a no-op once it failed) so closing the connection fails nothing more
            self._discard(conn)
            raise
        if conn.keep_alive and not conn.closed:
            self._idle.append(conn)
        else:
            self._discard(conn)
        return conn.status, conn.error_body

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        return conn

    def _discard(self, conn: _Connection) -> None:
        if conn.transport is not None and not conn.closed:
            conn.transport.close()

    def close(self) -> None:
        """Close the idle connections (those in use close when their request ends)."""
        for conn in self._idle:
            self._discard(conn)
        self._idle.clear()
