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

import math
from collections.abc import Iterable, Sequence

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvpilot.contract.tenancy import QUOTA_WINDOW_S
from kvpilot.router.quota.model import LIMIT_KINDS, Scope, Usage, Verdict, window_index

DEFAULT_KEY_PREFIX = "kvpilot:quota:"
# A dead store must answer fast: every admission waits on it. A new connection gets longer (a
# refused one fails at once anyway): a burst of admissions opens the pool's connections all at
# once, and a busy event loop must not take that for a dead store.
SOCKET_TIMEOUT_S = 0.25
CONNECT_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 32
POOL_WAIT_S = 1.0
WINDOW_TTL_S = 2 * QUOTA_WINDOW_S

# What a failed call raises: connection refused or reset, a timeout, a store that answers with
# an error. The keeper falls back on all of them.
STORE_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

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


class RedisQuotaStore:
    """Quota counters shared by every router on one Redis. Each call is one round trip; each
    raises one of STORE_ERRORS when the store cannot answer (within SOCKET_TIMEOUT_S once
    connected)."""

    def __init__(self, url: str, *, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        # Admissions beyond the pool's connections wait for one (each holds it for one round
        # trip) rather than open a connection each.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_WAIT_S,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            # The keeper decides what a failure means; a retry with backoff would only delay it.
            retry=Retry(NoBackoff(), 0),
        )
        self._redis = redis.Redis.from_pool(pool)
        self._prefix = key_prefix
        # Calls EVALSHA and loads the script again when the store restarted without it.
        self._admit = self._redis.register_script(ADMIT_LUA)

    def _window_key(self, scope_key: str, now: float) -> str:
        return f"{self._prefix}w:{window_index(now)}:{_slotted(scope_key)}"

    def _lease_key(self, scope_key: str) -> str:
        return f"{self._prefix}c:{_slotted(scope_key)}"

    async def admit(
        self,
        scopes: Sequence[Scope],
        prompt_tokens: int,
        lease_id: str,
        now: float,
        lease_expiry: float,
    ) -> Verdict:
        keys: list[str] = []
        limits: list[int] = []
        for scope in scopes:
            keys += [self._window_key(scope.key, now), self._lease_key(scope.key)]
            limits += [-1 if (v := scope.limit(kind)) is None else v for kind in LIMIT_KINDS]
        lease_ttl = _lease_set_ttl(now, lease_expiry)
        args = [repr(now), lease_id, repr(lease_expiry), lease_ttl, prompt_tokens, WINDOW_TTL_S]
        answer = [int(v) for v in await self._admit(keys=keys, args=args + limits)]
        usage = tuple(Usage(*answer[i : i + 3]) for i in range(2, len(answer), 3))
        if answer[0] == 0:
            return Verdict(None, None, usage)
        return Verdict(LIMIT_KINDS[answer[0] - 1], answer[1] - 1, usage)

    async def finish(
        self, scope_keys: Sequence[str], lease_id: str | None, tokens: int, now: float
    ) -> None:
        """Add `tokens` to each scope's current window and drop the lease (None: keep it)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            for key in scope_keys:
                if tokens:
                    window = self._window_key(key, now)
                    pipe.hincrby(window, "t", tokens)
                    pipe.expire(window, WINDOW_TTL_S)
                if lease_id is not None:
                    pipe.zrem(self._lease_key(key), lease_id)
            await pipe.execute()

    async def renew(
        self, leases: Iterable[tuple[Sequence[str], str]], now: float, expiry: float
    ) -> None:
        """Move the expiry of leases still in flight to `expiry`, all in one round trip. A lease
        the store lost (it restarted) is written again: the request still runs."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for scope_keys, lease_id in leases:
                for key in scope_keys:
                    pipe.zadd(self._lease_key(key), {lease_id: expiry})
                    pipe.expire(self._lease_key(key), _lease_set_ttl(now, expiry))
            await pipe.execute()

    async def drop(self, leases: Iterable[tuple[Sequence[str], str]]) -> None:
        """Remove leases (ones a renewal may have written back after they were settled)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for scope_keys, lease_id in leases:
                for key in scope_keys:
                    pipe.zrem(self._lease_key(key), lease_id)
            await pipe.execute()

    async def usage(self, scope_key: str, now: float) -> Usage:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hmget(self._window_key(scope_key, now), "r", "t")
            pipe.zcount(self._lease_key(scope_key), f"({now!r}", "+inf")
            (requests, tokens), concurrent = await pipe.execute()
        return Usage(int(requests or 0), int(tokens or 0), int(concurrent))

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


def _slotted(scope_key: str) -> str:
    """The scope key with its tenant as a hash tag: on a Redis Cluster every key of one tenant,
    hence of one admission's script, lies in the same slot."""
    tenant, bar, model = scope_key.partition("|")
    return f"{{{tenant}}}{bar}{model}"


def _lease_set_ttl(now: float, expiry: float) -> int:
    """Seconds a lease set outlives its last write: past every lease in it, so that the set of a
    scope nobody uses any more goes away with its leases."""
    return max(1, math.ceil(expiry - now) * 2)
