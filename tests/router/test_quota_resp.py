"""The quota store's Redis client (kvpilot.router.quota.resp): replies parsed whatever way the
bytes are split, URLs read, and against a real redis-server: pipelined commands answered in
order, error replies, a login with a password and a database, a store that stops answering
(every waiting command fails, the next one connects again), and a command whose caller stopped
waiting still applied."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.router.quota.resp import (
    IncompleteReply,
    RedisAddress,
    ReplyError,
    RespClient,
    encode,
    parse_reply,
)

from ..redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

TIMEOUT_S = 0.25


def client(url: str) -> RespClient:
    return RespClient(RedisAddress.from_url(url), reply_timeout_s=TIMEOUT_S, connect_timeout_s=1.0)


def test_a_reply_parses_the_same_whatever_way_its_bytes_are_split() -> None:
    wire = b"*5\r\n:-12\r\n$5\r\nab\r\nc\r\n$-1\r\n+OK\r\n*2\r\n-ERR no\r\n$0\r\n\r\n"
    whole, end = parse_reply(wire, 0)
    assert end == len(wire)
    assert whole[:4] == [-12, b"ab\r\nc", None, "OK"]
    error, empty = whole[4]
    assert isinstance(error, ReplyError) and str(error) == "ERR no" and empty == b""
    for cut in range(len(wire)):
        with pytest.raises(IncompleteReply):
            parse_reply(wire[:cut], 0)


def test_urls() -> None:
    assert RedisAddress.from_url("redis://r.example:6380/3") == RedisAddress("r.example", 6380, 3)
    assert RedisAddress.from_url("rediss://u:p%40ss@r/0") == RedisAddress(
        "r", 6379, 0, "u", "p@ss", tls=True
    )
    assert RedisAddress.from_url("redis://:pw@r").password == "pw"
    for bad in ("http://r", "redis://r/x", "redis://r?ssl_cert_reqs=none", "unix:///tmp/r.sock"):
        with pytest.raises(ValueError):
            RedisAddress.from_url(bad)


async def test_pipelined_commands_are_answered_in_order(redis_server: RedisServer) -> None:
    redis = client(redis_server.url)
    try:
        commands = [encode("INCRBY", "n", i) for i in range(1, 101)]
        replies = redis.send(b"".join(commands), len(commands))
        assert await asyncio.gather(*replies) == [i * (i + 1) // 2 for i in range(1, 101)]
        assert await redis.call(encode("GET", "n")) == b"5050"
        with pytest.raises(ReplyError, match="WRONGTYPE"):
            await redis.call(encode("HGET", "n", "f"))
        assert await redis.call(encode("PING")) == "PONG"  # the connection goes on
    finally:
        await redis.close()


async def test_a_login_with_password_and_database(redis_server: RedisServer) -> None:
    admin = client(redis_server.url)
    try:
        await admin.call(encode("CONFIG", "SET", "requirepass", "s3cret"))
        base = f"redis://:s3cret@127.0.0.1:{redis_server.port}"
        wrong = client(f"redis://:wrong@127.0.0.1:{redis_server.port}/2")
        with pytest.raises(ConnectionError) as refused:
            await wrong.call(encode("PING"))
        assert "wrong" not in str(refused.value)  # the password is never repeated
        await wrong.close()
        db2 = client(f"{base}/2")
        await db2.call(encode("SET", "k", "in-2"))
        db0 = client(f"{base}/0")
        assert await db0.call(encode("GET", "k")) is None
        assert await db2.call(encode("GET", "k")) == b"in-2"
        await db2.close()
        await db0.close()
    finally:
        await admin.close()


async def test_a_store_that_stops_answering_fails_the_waiting_commands_then_is_used_again(
    redis_server: RedisServer,
) -> None:
    redis, admin = client(redis_server.url), client(redis_server.url)
    try:
        assert await redis.call(encode("SET", "k", "1")) == "OK"
        await admin.call(encode("CLIENT", "PAUSE", 1500, "ALL"))
        waiting = redis.send(encode("INCR", "k") + encode("INCR", "k"), 2)
        started = asyncio.get_running_loop().time()
        for reply in waiting:
            with pytest.raises(TimeoutError):
                await reply
        assert asyncio.get_running_loop().time() - started < 3 * TIMEOUT_S
        # The next command has a connection of its own: its reply is its own, not a late one.
        with pytest.raises(TimeoutError):  # still paused
            await redis.call(encode("GET", "k"))
        while True:  # until the pause (a timer of the server's) is over
            try:
                value = await redis.call(encode("GET", "k"))
                break
            except TimeoutError:
                assert asyncio.get_running_loop().time() - started < 10
        assert value in (b"1", b"2", b"3")  # the INCRs may or may not have run
        assert await redis.call(encode("INCR", "fresh")) == 1
    finally:
        await redis.close()
        await admin.close()


async def test_a_command_whose_caller_stopped_waiting_still_applies(
    redis_server: RedisServer,
) -> None:
    redis = client(redis_server.url)
    try:
        # On a connection still being opened, and on an open one.
        for expected in (1, 2):
            waiter = asyncio.ensure_future(redis.call(encode("INCR", "k")))
            await asyncio.sleep(0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert await redis.call(encode("GET", "k")) == str(expected).encode()
    finally:
        await redis.close()
