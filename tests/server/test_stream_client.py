"""bench/common/stream_client.py (the load generator's streamed POSTs) and bench/common/client.py's
/health probe reader, against answers written byte by byte and real sockets."""

from __future__ import annotations

import asyncio
import importlib
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """bench/common/NAME.py as the scripts import it: common.NAME, with bench/ on sys.path."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(f"common.{name}")


@pytest.fixture(scope="module")
def sc() -> ModuleType:
    return load("stream_client")


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENTS = [b'{"choices":[{"text":"a"}]}', b'{"choices":[{"text":"\\u00e9\\n\\n"}]}', b"[DONE]"]
# Two events in one chunk, one event over two chunks, a data line with no space after the colon.
SSE_ANSWER = SSE_HEAD + chunked(
    b"data: " + EVENTS[0] + b"\n\ndata: " + EVENTS[1][:9],
    EVENTS[1][9:] + b"\n\n",
    b"data:" + EVENTS[2] + b"\n\n",
)


class FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


async def feed(sc: ModuleType, pieces: list[bytes]) -> tuple[list[bytes], object]:
    conn = sc._Connection()
    conn.connection_made(FakeTransport())
    events: list[bytes] = []
    done = conn.start(b"POST / HTTP/1.1\r\n\r\n", lambda data, now: events.append(data))
    for piece in pieces:
        conn.data_received(piece)
    return events, done


async def test_events_come_out_whole_however_the_bytes_are_split(sc: ModuleType) -> None:
    """Every split of the answer into two reads, and one byte per read, give the same events
    (a JSON string's escaped newlines are not event ends), and the answer completes."""
    splits = [[SSE_ANSWER[:i], SSE_ANSWER[i:]] for i in range(1, len(SSE_ANSWER))]
    splits.append([SSE_ANSWER[i : i + 1] for i in range(len(SSE_ANSWER))])
    for pieces in splits:
        events, done = await feed(sc, pieces)
        assert events == EVENTS, pieces
        assert done.done() and done.exception() is None  # type: ignore[attr-defined]


async def test_a_refused_request_keeps_its_body_and_sends_no_events(sc: ModuleType) -> None:
    body = b'{"error": {"message": "bad prompt"}}'
    answer = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    conn = sc._Connection()
    conn.connection_made(FakeTransport())
    events: list[bytes] = []
    done = conn.start(b"POST / HTTP/1.1\r\n\r\n", lambda data, now: events.append(data))
    conn.data_received(answer[:20])
    conn.data_received(answer[20:])
    assert done.done() and conn.status == 400 and conn.error_body == body and events == []


async def test_a_connection_lost_mid_answer_fails_the_request(sc: ModuleType) -> None:
    conn = sc._Connection()
    conn.connection_made(FakeTransport())
    done = conn.start(b"POST / HTTP/1.1\r\n\r\n", lambda data, now: None)
    conn.data_received(SSE_ANSWER[:60])
    assert not done.done()
    conn.connection_lost(None)
    with pytest.raises(sc.StreamError, match="closed mid-response"):
        await done


async def test_garbage_instead_of_http_fails_the_request(sc: ModuleType) -> None:
    conn = sc._Connection()
    transport = FakeTransport()
    conn.connection_made(transport)
    done = conn.start(b"POST / HTTP/1.1\r\n\r\n", lambda data, now: None)
    conn.data_received(b"SSH-2.0-OpenSSH\r\n\r\n")
    with pytest.raises(sc.StreamError, match="bad HTTP response"):
        await done
    assert transport.closed


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A TCP server running `handler` per connection; also returns the accepted-connection log."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername")[1])
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", accepted


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


async def test_connections_are_kept_alive_unless_the_server_closes(sc: ModuleType) -> None:
    bodies: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            bodies.append(body)
            close = body == b'{"last": true}'
            head = SSE_HEAD[:-2] + b"connection: close\r\n\r\n" if close else SSE_HEAD
            writer.write(head + SSE_ANSWER[len(SSE_HEAD) :])
            await writer.drain()
            if close:
                return

    server, url, accepted = await serve(answer)
    client = sc.StreamClient(url + "/base/")
    try:
        for body in (b"{}", b"{}", b'{"last": true}', b"{}"):
            events: list[bytes] = []
            status, error = await client.post("/v1/x", body, lambda d, now, to=events: to.append(d))
            assert (status, error, events) == (200, b"", EVENTS)
    finally:
        client.close()
        server.close()
        await server.wait_closed()
    assert bodies == [b"{}", b"{}", b'{"last": true}', b"{}"]
    assert len(accepted) == 2  # one for the first three, a new one after the server closed


async def test_a_silent_server_times_the_request_out(sc: ModuleType) -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)  # then nothing more
        await asyncio.sleep(5)

    server, url, _ = await serve(never)
    client = sc.StreamClient(url, read_timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError):
            await client.post("/", b"{}", lambda d, now: None)
        assert client._idle == []  # the timed-out connection is not reused
    finally:
        server.close()
        await server.wait_closed()


def test_the_client_refuses_https() -> None:
    module = load("stream_client")
    with pytest.raises(ValueError, match="plain http"):
        module.StreamClient("https://example.com")


# ---- common/client.read_response: the /health probe's reader ----------------------------------


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load("client")


def answer_over_socketpair(bench: ModuleType, *pieces: bytes) -> tuple[int, bool]:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        for piece in pieces:
            theirs.sendall(piece)
        theirs.shutdown(socket.SHUT_WR)
        return bench.read_response(ours)


def test_the_probe_reads_status_and_keep_alive(bench: ModuleType) -> None:
    ok = b'HTTP/1.1 200 OK\r\ncontent-type: x\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'
    assert answer_over_socketpair(bench, ok[:30], ok[30:]) == (200, True)
    down = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    assert answer_over_socketpair(bench, down) == (503, False)


def test_the_probe_refuses_what_it_cannot_read(bench: ModuleType) -> None:
    with pytest.raises(ConnectionError):  # closed before the body's end
        answer_over_socketpair(bench, b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
    with pytest.raises(ValueError, match="without Content-Length"):
        answer_over_socketpair(bench, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    with pytest.raises(ValueError, match="not an HTTP answer"):
        answer_over_socketpair(bench, b"hello\r\n\r\n")
