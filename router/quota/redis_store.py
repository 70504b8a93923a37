"""The shared quota store: counters in Redis that every router of the pool charges.

Keys, under a prefix (default `kvpilot:quota:`), the scope's tenant written as a hash tag
(`{ns/tenant}|model`):
- `w:{index}:{scope}`: a hash of the scope's window `index` (floor(now / QUOTA_WINDOW_S)),
  fields `r` (requests) and `t` (tokens); it expires two windows after it is last written.
- `c:{scope}`: a sorted set of the scope's concurrency leases, scored by expiry; members past
  their expiry are dropped on every admission, so a router that died frees its leases within
  the lease ttl.
Time is the routers' clock (passed in), not Redis's: the windows and expiries are the ones the
routers compute, and tests can move time.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

from kvpilot.contract.tenancy import QUOTA_WINDOW_S
from kvpilot.router.quota.model import LIMIT_KINDS, Scope, Usage, Verdict, window_index
from kvpilot.router.quota.resp import (
    RedisAddress,
    ReplyError,
    RespClient,
    encode,
    encode_ascii,
    encode_bulks,
)

DEFAULT_KEY_PREFIX = "kvpilot:quota:"
# A dead store must answer fast: every admission waits on it. A new connection gets longer (a
# refused one fails at once anyway): a busy event loop must not take a slow connect for a dead
# store.
SOCKET_TIMEOUT_S = 0.25
CONNECT_TIMEOUT_S = 1.0
WINDOW_TTL_S = 2 * QUOTA_WINDOW_S
# Scope sets whose encoded commands are kept (per window); past it they are encoded afresh.
_ENCODED_KEPT = 1024

# What a failed call raises: connection refused or reset, a timeout (TimeoutError and
# ConnectionError are OSErrors), a store that answers with an error. The keeper falls back on
# all of them.
STORE_ERRORS: tuple[type[BaseException], ...] = (ReplyError, OSError)

# Check every scope, then charge every scope, in one step. KEYS: per scope its window hash and
# its lease set. ARGV: now, lease id, lease expiry, lease-set ttl (s), prompt tokens, then per
# scope its limits (requests, tokens, concurrency; -1 = none). Returns: the refused kind (0 =
# admitted, 1..3 as LIMIT_KINDS), the refused scope (1-based, 0 = none), then per scope its
# requests, tokens and concurrent after the answer.
ADMIT_LUA = """
local now = tonumber(ARGV[1])
local lease = ARGV[2]
local expiry = ARGV[3]
local lease_ttl = tonumber(ARGV[4])
local prompt = tonumber(ARGV[5])
local window_ttl = tonumber(ARGV[6])
local n = #KEYS / 2
local used = {}
for i = 1, n do
  local leases = KEYS[2 * i]
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  local counts = redis.call('HMGET', KEYS[2 * i - 1], 'r', 't')
  used[i] = {tonumber(counts[1]) or 0, tonumber(counts[2]) or 0, redis.call('ZCARD', leases)}
end
local need = {1, prompt, 1}
for kind = 1, 3 do
  for i = 1, n do
    local limit = tonumber(ARGV[6 + 3 * (i - 1) + kind])
    if limit >= 0 and used[i][kind] + need[kind] > limit then
      local out = {kind, i}
      for j = 1, n do
        table.insert(out, used[j][1]); table.insert(out, used[j][2]); table.insert(out, used[j][3])
      end
      return out
    end
  end
end
local out = {0, 0}
for i = 1, n do
  local window, leases = KEYS[2 * i - 1], KEYS[2 * i]
  redis.call('HINCRBY', window, 'r', 1)
  redis.call('HINCRBY', window, 't', prompt)
  redis.call('EXPIRE', window, window_ttl)
  redis.call('ZADD', leases, expiry, lease)
  redis.call('EXPIRE', leases, lease_ttl)
  table.insert(out, used[i][1] + 1)
  table.insert(out, used[i][2] + prompt)
  table.insert(out, redis.call('ZCARD', leases))
end
return out
"""

# Settle or charge a lease, atomically. KEYS: per scope its window hash and its lease set. ARGV:
# tokens to add to each window (negative: a refund), the lease id to drop ('' = keep it), the
# window ttl (s).
FINISH_LUA = """
local tokens = tonumber(ARGV[1])
for i = 1, #KEYS / 2 do
  if tokens ~= 0 then
    redis.call('HINCRBY', KEYS[2 * i - 1], 't', tokens)
    redis.call('EXPIRE', KEYS[2 * i - 1], ARGV[3])
  end
  if ARGV[2] ~= '' then
    redis.call('ZREM', KEYS[2 * i], ARGV[2])
  end
end
return 0
"""


class _Script:
    """A Lua script, called by its SHA-1 (loaded on every connection) with EVAL as the fallback
    for a store that lost it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.load = encode("SCRIPT", "LOAD", source)
        self._name_and_sha = encode_bulks("EVALSHA", self.sha)

    def evalsha_parts(
        self, keys: Sequence[str], args_before: int, args_after: Sequence[str | int]
    ) -> tuple[bytes, bytes]:
        """A call's encoding around `args_before` arguments that change per call: its head
        (array header, EVALSHA, the SHA-1, the keys) and its tail (`args_after`)."""
        count = 3 + len(keys) + args_before + len(args_after)
        head = b"*%d\r\n" % count + self._name_and_sha + encode_bulks(len(keys), *keys)
        return head, encode_bulks(*args_after)

    def evalsha(self, keys: Sequence[str], args: Sequence[str | int]) -> bytes:
        return encode("EVALSHA", self.sha, len(keys), *keys, *args)

    def eval(self, keys: Sequence[str], args: Sequence[str | int]) -> bytes:
        return encode("EVAL", self.source, len(keys), *keys, *args)


_ADMIT = _Script(ADMIT_LUA)
_FINISH = _Script(FINISH_LUA)
_PING = encode("PING")


class RedisQuotaStore:
    """Quota counters shared by every router on one Redis (one connection, commands pipelined:
    router.quota.resp). Each call is one round trip; each raises one of STORE_ERRORS when the
    store cannot answer (within SOCKET_TIMEOUT_S once connected)."""

    def __init__(self, url: str, *, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self._client = RespClient(
            RedisAddress.from_url(url),
            reply_timeout_s=SOCKET_TIMEOUT_S,
            connect_timeout_s=CONNECT_TIMEOUT_S,
            on_connect=(_ADMIT.load, _FINISH.load),
        )
        self._prefix = key_prefix
        # scope key -> its lease-set key and the tail of its window keys: worked out once.
        self._keys: dict[str, tuple[str, str]] = {}
        # Per scope set, its calls of a script encoded for one window: (the window, the head,
        # the tail); the arguments that change per request go between.
        self._admits: dict[tuple[Scope, ...], tuple[int, bytes, bytes]] = {}
        self._finishes: dict[tuple[str, ...], tuple[int, bytes, bytes]] = {}

    def _scope_keys(self, scope_key: str) -> tuple[str, str]:
        keys = self._keys.get(scope_key)
        if keys is None:
            slotted = _slotted(scope_key)
            keys = self._keys[scope_key] = (f"{self._prefix}c:{slotted}", f":{slotted}")
        return keys

    def _window_key(self, scope_key: str, now: float) -> str:
        return f"{self._prefix}w:{window_index(now)}{self._scope_keys(scope_key)[1]}"

    def _lease_key(self, scope_key: str) -> str:
        return self._scope_keys(scope_key)[0]

    def _both_keys(self, scope_keys: Iterable[str], now: float) -> list[str]:
        return self._window_keys(scope_keys, window_index(now))

    def _window_keys(self, scope_keys: Iterable[str], index: int) -> list[str]:
        window = f"{self._prefix}w:{index}"
        keys: list[str] = []
        for scope_key in scope_keys:
            lease_key, tail = self._scope_keys(scope_key)
            keys += (window + tail, lease_key)
        return keys

    async def admit(
        self,
        scopes: Sequence[Scope],
        prompt_tokens: int,
        lease_id: str,
        now: float,
        lease_expiry: float,
    ) -> Verdict:
        lease_ttl = _lease_set_ttl(now, lease_expiry)
        varying = (repr(now), lease_id, repr(lease_expiry), str(lease_ttl), str(prompt_tokens))
        index = window_index(now)
        scope_set = tuple(scopes)
        encoded = self._admits.get(scope_set)
        if encoded is None or encoded[0] != index:
            keys = self._window_keys([scope.key for scope in scopes], index)
            parts = _ADMIT.evalsha_parts(keys, 5, _admit_fixed_args(scopes))
            encoded = _keep(self._admits, scope_set, (index, *parts))
        _, head, tail = encoded
        try:
            answer = await self._client.call(head + encode_ascii(*varying) + tail)
        except ReplyError as error:
            if not str(error).startswith("NOSCRIPT"):
                raise
            keys = self._both_keys([scope.key for scope in scopes], now)
            answer = await self._client.call(
                _ADMIT.eval(keys, [*varying, *_admit_fixed_args(scopes)])
            )
        usage = tuple(Usage(*answer[i : i + 3]) for i in range(2, len(answer), 3))
        if answer[0] == 0:
            return Verdict(None, None, usage)
        return Verdict(LIMIT_KINDS[answer[0] - 1], answer[1] - 1, usage)

    def finish(
        self, scope_keys: tuple[str, ...], lease_id: str | None, tokens: int, now: float
    ) -> asyncio.Future[Any]:
        """Add `tokens` (negative: a refund) to each scope's current window and drop the lease
        (None: keep it), in one step. Written at once; the Future says whether the store took
        it (a store that lost the script fails it, and the lease expires with its ttl)."""
        index = window_index(now)
        encoded = self._finishes.get(scope_keys)
        if encoded is None or encoded[0] != index:
            parts = _FINISH.evalsha_parts(self._window_keys(scope_keys, index), 2, [WINDOW_TTL_S])
            encoded = _keep(self._finishes, scope_keys, (index, *parts))
        _, head, tail = encoded
        command = head + encode_ascii(str(tokens), lease_id or "") + tail
        return self._client.send(command)[0]

    async def renew(
        self, leases: Iterable[tuple[Sequence[str], str]], now: float, expiry: float
    ) -> None:
        """Move the expiry of leases still in flight to `expiry`, all in one round trip. A lease
        the store lost (it restarted) is written again: the request still runs."""
        commands: list[bytes] = []
        ttl = _lease_set_ttl(now, expiry)
        for scope_keys, lease_id in leases:
            for key in scope_keys:
                commands.append(encode("ZADD", self._lease_key(key), repr(expiry), lease_id))
                commands.append(encode("EXPIRE", self._lease_key(key), ttl))
        await self._all(commands)

    async def drop(self, leases: Iterable[tuple[Sequence[str], str]]) -> None:
        """Remove leases (ones a renewal may have written back after they were settled)."""
        commands = [
            encode("ZREM", self._lease_key(key), lease_id)
            for scope_keys, lease_id in leases
            for key in scope_keys
        ]
        await self._all(commands)

    async def usage(self, scope_key: str, now: float) -> Usage:
        commands = [
            encode("MULTI"),
            encode("HMGET", self._window_key(scope_key, now), "r", "t"),
            encode("ZCOUNT", self._lease_key(scope_key), f"({now!r}", "+inf"),
            encode("EXEC"),
        ]
        (requests, tokens), concurrent = (await self._all(commands))[-1]
        return Usage(int(requests or 0), int(tokens or 0), int(concurrent))

    async def _all(self, commands: list[bytes]) -> list[Any]:
        """Pipelined: written together, their replies in order (the first error raised)."""
        if not commands:
            return []
        replies = self._client.send(b"".join(commands), len(commands))
        answers = await asyncio.gather(*replies, return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return answers

    async def ping(self) -> None:
        await self._client.call(_PING)

    async def close(self) -> None:
        await self._client.close()


def _keep(cache: dict[Any, Any], key: Any, value: Any) -> Any:
    """Store `value` in a cache bounded by _ENCODED_KEPT (emptied when full)."""
    if len(cache) >= _ENCODED_KEPT:
        cache.clear()
    cache[key] = value
    return value


def _admit_fixed_args(scopes: Iterable[Scope]) -> list[str | int]:
    """The admission script's arguments after the per-request ones: the window ttl, then per
    scope its limits."""
    args: list[str | int] = [WINDOW_TTL_S]
    for scope in scopes:
        args += [-1 if (v := scope.limit(kind)) is None else v for kind in LIMIT_KINDS]
    return args


def _slotted(scope_key: str) -> str:
    """The scope key with its tenant as a hash tag: on a Redis Cluster every key of one tenant,
    hence of one admission's script, lies in the same slot."""
    tenant, bar, model = scope_key.partition("|")
    return f"{{{tenant}}}{bar}{model}"


def _lease_set_ttl(now: float, expiry: float) -> int:
    """Seconds a lease set outlives its last write: past every lease in it, so that the set of a
    scope nobody uses any more goes away with its leases."""
    return max(1, math.ceil(expiry - now) * 2)
