"""A lean Redis client for the quota store: RESP2 on one asyncio connection, every command
written to the socket the moment it is sent and its reply matched in order (Redis answers a
connection's commands in the order they came), with no task, lock or pool per call.

The quota store makes one or two calls per request (an admission's script, its settle), on the
request's path: a general client's per-call machinery (a connection pool, a retry wrapper,
generic command packing and parsing) cost about as much CPU as the rest of the router's work on
a request (bench/RESULTS.md). Callers encode their commands once (`encode`, or bytes of their
own) and get a Future of the reply.

A command whose reply does not come within `reply_timeout_s` of its writing ends the connection
(no later reply could be matched any more): every command awaiting a reply fails with
TimeoutError, and the next command connects again. A lost connection fails them with
ConnectionError; a refused or slow connect with OSError or TimeoutError.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote, urlsplit

DEFAULT_PORT = 6379


class ReplyError(Exception):
    """An error reply of the server (`NOSCRIPT ...`, `WRONGTYPE ...`): the message as sent."""


@dataclass(frozen=True)
class RedisAddress:
    """Where the store is and how to log in, from a `redis://` or `rediss://` (TLS) URL:
    `redis://[[username]:password@]host[:port][/db]`."""

    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @classmethod
    def from_url(cls, url: str) -> RedisAddress:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"a quota store URL is redis://... or rediss://..., not {url!r}")
        if parts.query:
            raise ValueError("a quota store URL takes no query options")
        path = parts.path.strip("/")
        try:
            db = int(path) if path else 0
            port = parts.port or DEFAULT_PORT
        except ValueError:
            raise ValueError("a quota store URL's port and database are numbers") from None
        return cls(
            host=parts.hostname or "localhost",
            port=port,
            db=db,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
            tls=parts.scheme == "rediss",
        )


def encode(*args: bytes | str | int) -> bytes:
    """One command as RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + encode_bulks(*args)


def encode_bulks(*args: bytes | str | int) -> bytes:
    """Arguments as bulk strings, without the array's header: a part of a command."""
    out = []
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def encode_ascii(*args: str) -> bytes:
    """Bulk strings of ASCII arguments (numbers, ids), without the array's header: the part of a
    command that changes per call, the rest encoded once by the caller."""
    return "".join([f"${len(arg)}\r\n{arg}\r\n" for arg in args]).encode()


class IncompleteReply(Exception):
    """The buffer ends inside a reply: wait for more bytes."""


def parse_reply(buffer: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 reply from `pos`: its value and the position after it. Integers as int, bulk
    strings as bytes (None for a null), simple strings as str, arrays as lists, an error as a
    ReplyError instance (not raised: it answers one command only)."""
    end = buffer.find(b"\r\n", pos)
    if end < 0:
        raise IncompleteReply
    kind, line = buffer[pos], buffer[pos + 1 : end]
    pos = end + 2
    if kind == 0x3A:  # ':'
        return int(line), pos
    if kind == 0x24:  # '$'
        size = int(line)
        if size < 0:
            return None, pos
        if len(buffer) < pos + size + 2:
            raise IncompleteReply
        return bytes(buffer[pos : pos + size]), pos + size + 2
    if kind == 0x2A:  # '*'
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = parse_reply(buffer, pos)
            items.append(item)
        return items, pos
    if kind == 0x2B:  # '+'
        return line.decode(), pos
    if kind == 0x2D:  # '-'
        return ReplyError(line.decode(errors="replace")), pos
    raise ConnectionError(f"not a RESP reply: type byte {kind:#04x}")


class _Pending:
    __slots__ = ("future", "written_at")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future
        self.written_at = 0.0  # the loop's clock


class _Connection(asyncio.Protocol):
    """One socket: writes commands, parses replies, resolves their futures in order."""

    def __init__(self, client: RespClient) -> None:
        self._client = client
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.pending: collections.deque[_Pending] = collections.deque()
        self.closed = False
        # One timer, not one per command: armed for the oldest command awaiting its reply
        # (replies come in order, so it is the first one late).
        self._watchdog: asyncio.TimerHandle | None = None
        self._timeout_s = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        pos = 0
        try:
            while pos < len(buffer) and self.pending:
                try:
                    reply, pos = parse_reply(buffer, pos)
                except IncompleteReply:
                    break
                entry = self.pending.popleft()
                if not entry.future.done():  # its caller may have stopped waiting
                    if isinstance(reply, ReplyError):
                        entry.future.set_exception(reply)
                    else:
                        entry.future.set_result(reply)
        except (ConnectionError, ValueError) as error:  # not Redis on the other end
            self.fail(ConnectionError(f"the quota store sent what is not RESP: {error}"))
            return
        del buffer[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError(f"the quota store closed the connection ({exc or 'EOF'})"))

    def write(self, data: bytes, entries: list[_Pending], timeout_s: float) -> None:
        if self.closed:  # lost between its opening and this write
            for entry in entries:
                if not entry.future.done():
                    entry.future.set_exception(
                        ConnectionError("the quota store connection is gone")
                    )
            return
        assert self.transport is not None
        self.transport.write(data)
        loop = asyncio.get_running_loop()
        now = loop.time()
        for entry in entries:
            entry.written_at = now
        self.pending.extend(entries)
        self._timeout_s = timeout_s
        if self._watchdog is None:
            self._watchdog = loop.call_at(now + timeout_s, self._check)

    def _check(self) -> None:
        self._watchdog = None
        if not self.pending or self.closed:
            return
        loop = asyncio.get_running_loop()
        due = self.pending[0].written_at + self._timeout_s
        if loop.time() >= due:
            self.fail(TimeoutError("the quota store did not answer in time"))
        else:
            self._watchdog = loop.call_at(due, self._check)

    def fail(self, error: Exception, *, abort: bool = True) -> None:
        """End the connection: every command without its reply fails with `error`. `abort`
        False: what is written still goes out (the client closes)."""
        if self.closed:
            return
        self.closed = True
        self._client.lost(self)
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        while self.pending:
            entry = self.pending.popleft()
            if not entry.future.done():
                entry.future.set_exception(error)


class RespClient:
    """Commands to one Redis server over one connection, opened on the first command and again
    on the first after it was lost. `send` writes at once (or as soon as the connection is up)
    and returns the Future of the reply; nothing on the caller's side needs to await it for the
    command to go."""

    def __init__(
        self,
        address: RedisAddress,
        *,
        reply_timeout_s: float,
        connect_timeout_s: float,
        on_connect: Sequence[bytes] = (),
    ) -> None:
        """`on_connect`: encoded commands every new connection sends first (after its login),
        each of which must succeed (e.g. SCRIPT LOAD of the scripts later called by SHA-1)."""
        self.address = address
        self.on_connect = tuple(on_connect)
        self.reply_timeout_s = reply_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        # Commands sent while the connection is being opened: written once it is.
        self._backlog: list[tuple[bytes, list[_Pending]]] = []
        self._closed = False

    def send(self, data: bytes, replies: int = 1) -> list[asyncio.Future[Any]]:
        """Write `data` (`replies` encoded commands) and return the Futures of their replies."""
        if self._closed:
            raise ConnectionError("the quota store client is closed")
        loop = asyncio.get_running_loop()
        entries = [_Pending(loop.create_future()) for _ in range(replies)]
        connection = self._connection
        if connection is not None:
            connection.write(data, entries, self.reply_timeout_s)
        else:
            self._backlog.append((data, entries))
            if self._connecting is None:
                self._connecting = loop.create_task(self._connect(), name="quota-store-connect")
        return [entry.future for entry in entries]

    async def call(self, data: bytes) -> Any:
        """One command's reply (a ReplyError is raised)."""
        return await self.send(data)[0]

    def lost(self, connection: _Connection) -> None:
        if self._connection is connection:
            self._connection = None

    async def _connect(self) -> None:
        address = self.address
        loop = asyncio.get_running_loop()
        connection = _Connection(self)
        try:
            context = ssl.create_default_context() if address.tls else None
            # uvloop may call connection_made after create_connection returns: its transport.
            connection.transport, _ = await asyncio.wait_for(
                loop.create_connection(
                    lambda: connection,
                    address.host,
                    address.port,
                    ssl=context,
                    server_hostname=address.host if context else None,
                ),
                self.connect_timeout_s,
            )
            hello: list[bytes] = []
            if address.password is not None:
                login = [address.username] if address.username else []
                hello.append(encode("AUTH", *login, address.password))
            if address.db:
                hello.append(encode("SELECT", address.db))
            hello += self.on_connect
            if hello:
                entries = [_Pending(loop.create_future()) for _ in hello]
                connection.write(b"".join(hello), entries, self.connect_timeout_s)
                for entry in entries:
                    await entry.future
        except BaseException as error:
            connection.fail(ConnectionError("connect failed"))
            backlog, self._backlog = self._backlog, []
            failure = error if isinstance(error, Exception) else ConnectionError("cancelled")
            if isinstance(error, ReplyError):  # said without the secret
                failure = ConnectionError(f"the quota store refused the connection: {error}")
            for _, entries in backlog:
                for entry in entries:
                    if not entry.future.done():
                        entry.future.set_exception(failure)
            if not isinstance(error, Exception):
                raise
            return
        finally:
            self._connecting = None
        self._connection = connection
        backlog, self._backlog = self._backlog, []
        for data, entries in backlog:
            # Written even when its caller stopped waiting: a settle must still reach the store.
            connection.write(data, entries, self.reply_timeout_s)

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
        if self._connection is not None:
            self._connection.fail(ConnectionError("the quota store client was closed"), abort=False)
