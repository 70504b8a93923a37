"""The router's HTTP/1.1 client for forwarding requests to engines: keep-alive connections per
engine, a request written in one piece, the response parsed by httptools (llhttp, C: lengths,
chunked bodies, keep-alive) and its body handed on as the socket delivers it.

Why not aiohttp: forwarding is the router's overhead on every request, and aiohttp's client
(URL objects, cookie jar, header multidicts, tracing hooks, a stream reader) cost the router more
CPU per request than choosing the replica did (bench/RESULTS.md). This client does only what the
proxy needs: POST a body, read the status and headers, then the body whole or chunk by chunk.

Failures: ConnectError before the response's status line (nothing of the request was answered:
the proxy tries another replica), BrokenResponse once it started.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

# Idle connections are closed before the engines' uvicorn closes them (after 5 s), so a reused
# connection is never one the engine is closing.
KEEPALIVE_S = 4.0
CONNECT_TIMEOUT_S = 10.0
# Body bytes buffered for a slow reader before the socket stops being read.
_HIGH_WATER = 1 << 18


Address = tuple[str, str, int, str]  # scheme, host, port, and host:port for the Host header


@functools.lru_cache(maxsize=1024)
def address(base_url: str) -> Address:
    parsed = urlsplit(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.scheme, parsed.hostname, port, parsed.netloc


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


class ConnectError(ConnectionError):
    """The engine could not be reached, or closed the connection before answering."""


class BrokenResponse(ConnectionError):
    """The response broke off after it started (or was not valid HTTP)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; httptools calls the on_* methods while it parses."""

    def __init__(self, pool: UpstreamPool, key: Address) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.is_closed = False
        self.idle_since = 0.0
        self.response: UpstreamResponse | None = None

    # ---- asyncio ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio class

    def data_received(self, data: bytes) -> None:
        if self.is_closed:
            return
        if self.response is None:  # bytes no request asked for: the connection is unusable
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BrokenResponse(f"invalid HTTP from the engine: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self.pool.forget(self)
        self._fail(ConnectError(f"the engine closed the connection ({exc or 'EOF'})"))

    def pause_writing(self) -> None:  # bodies are written whole; the kernel buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # ---- httptools ----
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        if not response.started.done():
            response.started.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        response.finish(keep_alive=self.parser.should_keep_alive())

    # ---- ours ----
    def _fail(self, error: ConnectionError) -> None:
        response, self.response = self.response, None
        if response is None:
            return
        if not response.started.done():
            response.started.set_exception(error)
        elif not response.is_eof:
            response.fail(BrokenResponse(str(error)))

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            assert self.transport is not None
            self.transport.close()


class UpstreamResponse:
    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self.status = 0
        self.raw_headers: list[tuple[str, str]] = []
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.is_eof = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._error: BrokenResponse | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False
        self._done = False  # released or closed

    # ---- fed by the connection ----
    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > _HIGH_WATER:
            assert self.connection.transport is not None
            self.connection.transport.pause_reading()
        self._wake()

    def finish(self, *, keep_alive: bool) -> None:
        self.is_eof = True
        self._keep_alive = keep_alive
        self._wake()

    def fail(self, error: BrokenResponse) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---- read by the proxy ----
    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk as it arrives (everything buffered since the last one
        together). BrokenResponse when it breaks off."""
        while True:
            if self._chunks:
                if len(self._chunks) == 1:
                    chunk = self._chunks.popleft()
                else:
                    chunk = b"".join(self._chunks)
                    self._chunks.clear()
                if self._buffered > _HIGH_WATER and not self.connection.is_closed:
                    assert self.connection.transport is not None
                    self.connection.transport.resume_reading()
                self._buffered = 0
                yield chunk
                continue
            if self.is_eof:
                return
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def release(self) -> None:
        """Done with it: the connection goes back to the pool when the body was read to its end
        and the engine keeps it alive, else it is closed."""
        if self._done:
            return
        self._done = True
        connection = self.connection
        connection.response = None
        if self.is_eof and self._keep_alive and not connection.is_closed:
            connection.pool.put_back(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Done with it before its end (the client went away): the connection is closed, which
        tells the engine to stop generating."""
        self._keep_alive = False
        self.release()


class UpstreamPool:
    """Keep-alive connections to every engine, reused most recent first."""

    def __init__(self) -> None:
        self._idle: dict[Address, list[_Connection]] = {}

    async def post(
        self, base_url: str, target: str, headers: dict[str, str], body: bytes
    ) -> UpstreamResponse:
        """The response once its status line and headers arrived (the body follows).
        base_url: http(s)://host:port of the engine; target: the path."""
        key = address(base_url)
        connection = self._take(key) or await self._connect(key)
        response = connection.response = UpstreamResponse(connection)
        head = [f"POST {target} HTTP/1.1\r\nHost: {key[3]}\r\nContent-Length: {len(body)}"]
        head += [f"\r\n{name}: {value}" for name, value in headers.items()]
        head.append("\r\n\r\n")
        assert connection.transport is not None
        connection.transport.write("".join(head).encode("latin-1") + body)
        try:
            await response.started
        except BaseException:
            connection.close()
            raise
        return response

    def _take(self, key: Address) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.is_closed and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.close()
        return None

    async def _connect(self, key: Address) -> _Connection:
        scheme, host, port, _ = key
        loop = asyncio.get_running_loop()
        context = _tls_context() if scheme == "https" else None
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key), host, port, ssl=context),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectError(f"cannot connect to {host}:{port}: {exc!r}") from None
        return connection

    def put_back(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        idle = self._idle.setdefault(connection.key, [])
        # Connections idle past the keep-alive are dropped here too, not only when taken.
        while idle and connection.idle_since - idle[0].idle_since >= KEEPALIVE_S:
            idle.pop(0).close()
        idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
