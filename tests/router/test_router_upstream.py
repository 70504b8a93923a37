"""The router's HTTP/1.1 client to the engines (kvpilot.router.upstream) against a real aiohttp
server on loopback: whole and chunked bodies, chunks as they are sent, keep-alive reuse, a
response that breaks off, an engine that is not there, and a stream closed early."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvpilot.router.upstream import BrokenResponse, ConnectError, UpstreamPool


class Engine:
    """Answers like an engine would, and records what it was sent and over which connection."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes, int]] = []
        self.release_chunk = asyncio.Event()
        self.stream_cancelled = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        assert request.transport is not None
        connection = id(request.transport)
        self.requests.append((request.path, dict(request.headers), body, connection))
        if request.path == "/json":
            return web.json_response({"echo": body.decode()}, headers={"x-request-id": "r1"})
        if request.path == "/error":
            return web.json_response({"error": "busy"}, status=503)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        if request.path == "/stream":
            for i in range(3):
                await response.write(f"data: {i}\n\n".encode())
                await self.release_chunk.wait()
                self.release_chunk.clear()
            await response.write_eof()
            return response
        if request.path == "/broken":
            await response.write(b"data: 0\n\n")
            request.transport.close()  # mid-body: the chunked body never ends
            return response
        try:  # /endless: until the client goes away
            while True:
                await response.write(b"data: tick\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            self.stream_cancelled.set()
            raise


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, str]]:
    served = Engine()
    app = web.Application()
    app.router.add_post("/{path}", served.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield served, f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    upstream = UpstreamPool()
    yield upstream
    upstream.close()


async def test_a_whole_body_and_keep_alive(engine: tuple[Engine, str], pool: UpstreamPool) -> None:
    served, url = engine
    for i in range(3):
        headers = {"content-type": "application/json", "authorization": "Bearer k"}
        response = await pool.post(url, "/json", headers, f"hello {i}".encode())
        assert response.status == 200
        assert ("x-request-id", "r1") in response.raw_headers
        assert json.loads(await response.read()) == {"echo": f"hello {i}"}
        response.release()
    paths = [(path, h["Authorization"], h["Content-Type"], b) for path, h, b, _ in served.requests]
    assert paths == [
        ("/json", "Bearer k", "application/json", f"hello {i}".encode()) for i in range(3)
    ]
    # One connection, reused for every request.
    assert len({connection for *_, connection in served.requests}) == 1


async def test_an_error_status_is_a_response(
    engine: tuple[Engine, str], pool: UpstreamPool
) -> None:
    _, url = engine
    response = await pool.post(url, "/error", {}, b"{}")
    assert response.status == 503
    assert json.loads(await response.read()) == {"error": "busy"}
    response.release()


async def test_chunks_arrive_as_they_are_sent(
    engine: tuple[Engine, str], pool: UpstreamPool
) -> None:
    served, url = engine
    response = await pool.post(url, "/stream", {}, b"{}")
    assert response.status == 200
    assert ("content-type", "text/event-stream") in response.raw_headers
    received = []

    async def consume() -> None:
        async for chunk in response.chunks():
            received.append(chunk)
            # The engine sends the next chunk only after this one arrived here.
            served.release_chunk.set()

    await asyncio.wait_for(consume(), 10)  # a client that waits for the end never gets it
    assert received == [f"data: {i}\n\n".encode() for i in range(3)]
    assert response.is_eof
    response.release()
    # The connection went back to the pool and carries the next request.
    again = await pool.post(url, "/json", {}, b"x")
    assert json.loads(await again.read()) == {"echo": "x"}
    again.release()
    assert served.requests[0][3] == served.requests[1][3]


async def test_a_response_that_breaks_off_raises(
    engine: tuple[Engine, str], pool: UpstreamPool
) -> None:
    _, url = engine
    response = await pool.post(url, "/broken", {}, b"{}")
    assert response.status == 200
    received = []
    with pytest.raises(BrokenResponse):
        async for chunk in response.chunks():
            received.append(chunk)
    assert received == [b"data: 0\n\n"]
    response.close()


async def test_an_engine_that_is_not_there(pool: UpstreamPool) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectError):
        await pool.post(f"http://127.0.0.1:{port}", "/json", {}, b"{}")


async def test_a_stream_closed_early_closes_its_connection(
    engine: tuple[Engine, str], pool: UpstreamPool
) -> None:
    served, url = engine
    response = await pool.post(url, "/endless", {}, b"{}")
    async for _ in response.chunks():
        break
    response.close()  # the client went away
    await asyncio.wait_for(served.stream_cancelled.wait(), 5)
    # Not reused: the next request opens another connection.
    again = await pool.post(url, "/json", {}, b"y")
    assert json.loads(await again.read()) == {"echo": "y"}
    again.release()
    assert served.requests[0][3] != served.requests[1][3]
