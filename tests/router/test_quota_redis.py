"""The shared quota store against a real redis-server: several routers on one budget, a router
that dies holding leases, and a store that dies and comes back."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as redis

from kvpilot.contract.tenancy import QUOTA_WINDOW_S, Quota
from kvpilot.router.quota import QuotaKeeper, Scope, Usage, tenant_scope_key
from kvpilot.router.quota.model import window_index

from ..redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

TENANT = tenant_scope_key("team-a", "batch")
# Tests that count in a window run at a fixed time, 10 s into a window: a real clock could cross
# into the next window in the middle of one.
NOW = 1_000_000 * QUOTA_WINDOW_S + 10.0


def fixed_clock() -> float:
    return NOW


@asynccontextmanager
async def running(keeper: QuotaKeeper) -> AsyncIterator[QuotaKeeper]:
    await keeper.start()
    try:
        yield keeper
    finally:
        await keeper.stop()


async def test_two_routers_share_one_budget_exactly(redis_server: RedisServer) -> None:
    scopes = [Scope(TENANT, Quota(tokens_per_minute=1000, requests_per_minute=150))]
    async with (
        running(QuotaKeeper(redis_server.url, clock=fixed_clock)) as one,
        running(QuotaKeeper(redis_server.url, clock=fixed_clock)) as two,
    ):
        decisions = await asyncio.gather(
            *(keeper.admit(scopes, 10, "closed") for _ in range(150) for keeper in (one, two))
        )
        admitted = [d for d in decisions if d.admitted]
        assert len(admitted) == 100  # 1000 tokens / 10 per prompt, not one more
        assert {d.reason for d in decisions if not d.admitted} == {"tokens_per_minute"}
        assert await one.usage(TENANT) == await two.usage(TENANT) == Usage(100, 1000, 100)
        # Each router settles its own requests; the budget seen by both includes every one.
        for keeper, decision in zip((one, two) * 150, decisions, strict=True):
            if decision.admitted:
                await keeper.settle(decision.lease, 5)
        assert await two.usage(TENANT) == Usage(100, 1500, 0)


async def test_a_settle_cancelled_with_its_client_still_releases(
    redis_server: RedisServer,
) -> None:
    scopes = [Scope(TENANT, Quota(max_concurrent=1, tokens_per_minute=1000))]
    async with running(QuotaKeeper(redis_server.url, clock=fixed_clock)) as other:
        async with running(QuotaKeeper(redis_server.url, clock=fixed_clock)) as keeper:
            lease = (await keeper.admit(scopes, 10, "closed")).lease
            settle = asyncio.create_task(keeper.settle(lease, 25))
            await asyncio.sleep(0)  # the settle has sent its release
            settle.cancel()  # the client went away: its handler is cancelled
            with pytest.raises(asyncio.CancelledError):
                await settle
        # The release went on without its caller: the slot is free and the tokens counted.
        assert await other.usage(TENANT) == Usage(requests=1, tokens=35, concurrent=0)


async def test_a_request_without_limits_writes_nothing(redis_server: RedisServer) -> None:
    async with running(QuotaKeeper(redis_server.url, clock=fixed_clock)) as keeper:
        decision = await keeper.admit([Scope(TENANT, Quota())], 10, "closed")
        assert decision.admitted and decision.lease is None
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert await client.dbsize() == 0
            await keeper.admit([Scope(TENANT, Quota(requests_per_minute=1))], 10, "closed")
            keys = await client.keys("*")
            ttls = [await client.ttl(key) for key in keys]
        finally:
            await client.aclose()
        assert sorted(k.decode() for k in keys) == [
            "kvpilot:quota:c:{team-a/batch}",
            f"kvpilot:quota:w:{window_index(NOW)}:{{team-a/batch}}",
        ]
        assert all(ttl > 0 for ttl in ttls)  # nothing outlives its window or its leases


# A router in its own process: admits one request, says so, and runs until it is killed.
ROUTER = """
import asyncio, sys
from kvpilot.contract.tenancy import QUOTA_WINDOW_S, Quota
from kvpilot.router.quota import QuotaKeeper, Scope

async def main():
    keeper = QuotaKeeper(sys.argv[1], lease_ttl_s=float(sys.argv[2]))
    await keeper.start()
    decision = await keeper.admit([Scope(sys.argv[3], Quota(max_concurrent=1))], 1, "closed")
    print("admitted" if decision.admitted else decision.reason, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_dead_router_frees_its_concurrency_after_the_ttl(
    redis_server: RedisServer,
) -> None:
    ttl = 0.6
    router = subprocess.Popen(
        [sys.executable, "-c", ROUTER, redis_server.url, str(ttl), TENANT],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert router.stdout is not None
        line = await asyncio.to_thread(router.stdout.readline)
        assert line.strip() == "admitted"
        scopes = [Scope(TENANT, Quota(max_concurrent=1))]
        async with running(QuotaKeeper(redis_server.url, lease_ttl_s=ttl)) as keeper:
            assert (await keeper.admit(scopes, 1, "closed")).reason == "concurrency"
            # Alive, the router renews its lease: two ttls later it still holds the slot.
            await asyncio.sleep(2 * ttl)
            assert (await keeper.admit(scopes, 1, "closed")).reason == "concurrency"
            router.kill()
            await asyncio.to_thread(router.wait)
            # Dead, it renews nothing: once its last renewal runs out the slot is free.
            await asyncio.sleep(ttl)
            assert (await keeper.admit(scopes, 1, "closed")).admitted
    finally:
        router.kill()
        router.wait()
        if router.stdout is not None:
            router.stdout.close()


async def test_a_dead_store_fails_open_or_closed_and_is_used_again(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvpilot.router.quota")
    open_scope = [Scope(tenant_scope_key("team-a", "open"), Quota(requests_per_minute=5))]
    closed_key = tenant_scope_key("team-b", "closed")
    closed_scope = [Scope(closed_key, Quota(requests_per_minute=5))]
    keeper = QuotaKeeper(redis_server.url, clock=fixed_clock, probe_interval_s=0.05)
    async with running(keeper):
        assert keeper.store_up
        for _ in range(2):
            assert (await keeper.admit(open_scope, 10, "open")).admitted
        assert (await keeper.admit(closed_scope, 10, "closed")).admitted

        redis_server.stop()
        outcomes = []
        for scope, mode in [(closed_scope, "closed")] * 3 + [(open_scope, "open")] * 4:
            started = time.monotonic()
            outcomes.append((await keeper.admit(scope, 10, mode)).reason)
            assert time.monotonic() - started < 1.0
        assert not keeper.store_up
        # Closed: refused. Open: this router's own count (2 before the store died) holds rpm 5.
        assert outcomes == ["store_unavailable"] * 3 + [None, None, None, "requests_per_minute"]
        assert (await keeper.usage(open_scope[0].key)).requests == 5

        redis_server.start()  # same port, empty: it persisted nothing
        await asyncio.wait_for(keeper.wait_store_up(), timeout=5.0)
        assert keeper.store_up
        assert (await keeper.admit(closed_scope, 10, "closed")).admitted
        async with running(QuotaKeeper(redis_server.url, clock=fixed_clock)) as other:
            assert (await other.usage(closed_key)).requests == 1  # counted in Redis again

    messages = [r.getMessage() for r in caplog.records]
    assert sum("quota store unreachable" in m for m in messages) == 1
    assert sum("quota store reachable again" in m for m in messages) == 1


async def test_a_keeper_starts_while_the_store_is_down(redis_server: RedisServer) -> None:
    redis_server.stop()
    scopes = [Scope(TENANT, Quota(requests_per_minute=1))]
    keeper = QuotaKeeper(redis_server.url, clock=fixed_clock, probe_interval_s=0.05)
    async with running(keeper):
        assert not keeper.store_up
        assert (await keeper.admit(scopes, 1, "closed")).reason == "store_unavailable"
        assert (await keeper.admit(scopes, 1, "open")).admitted
        redis_server.start()
        await asyncio.wait_for(keeper.wait_store_up(), timeout=5.0)
        assert (await keeper.admit(scopes, 1, "closed")).admitted


async def test_leases_in_flight_are_written_back_to_a_restarted_store(
    redis_server: RedisServer,
) -> None:
    ttl = 0.3
    scopes = [Scope(TENANT, Quota(max_concurrent=1))]
    keeper = QuotaKeeper(redis_server.url, lease_ttl_s=ttl, probe_interval_s=0.05)
    async with running(keeper):
        lease = (await keeper.admit(scopes, 1, "closed")).lease
        redis_server.stop()
        redis_server.start()  # empty: the lease is gone from it
        async with running(QuotaKeeper(redis_server.url)) as other:
            assert (await other.usage(TENANT)).concurrent == 0
            # A renewal (every ttl / 3) finds the store gone, the probe finds it back, the next
            # renewal writes the request's lease back: all well within three ttls.
            await asyncio.sleep(3 * ttl)
            assert (await other.admit(scopes, 1, "closed")).reason == "concurrency"
            await keeper.settle(lease, 0)
            assert (await other.admit(scopes, 1, "closed")).admitted


async def test_headroom_follows_the_stores_answers_and_admissions_on_their_way(
    redis_server: RedisServer,
) -> None:
    scopes = [Scope(TENANT, Quota(requests_per_minute=100, tokens_per_minute=1000))]
    async with running(QuotaKeeper(None, clock=fixed_clock)) as alone:
        await alone.admit(scopes, 10, "open")
        assert not alone.has_headroom(scopes, 10)  # no store: nothing to go ahead of
    async with running(QuotaKeeper(redis_server.url, clock=fixed_clock)) as keeper:
        assert not keeper.has_headroom(scopes, 10)  # the store has not answered for it
        await keeper.admit(scopes, 10, "open")
        assert keeper.has_headroom(scopes, 10)
        assert keeper.has_headroom(scopes, 880)  # 890 of 1000 after it: 11 % left
        assert not keeper.has_headroom(scopes, 900)  # 10 of it left: under HEADROOM
        # Admissions on their way count as spent until the store answers them.
        pending = [asyncio.ensure_future(keeper.admit(scopes, 400, "open")) for _ in range(2)]
        await asyncio.sleep(0)
        assert not keeper.has_headroom(scopes, 100)
        await asyncio.gather(*pending)
        assert not keeper.has_headroom(scopes, 100)  # the store's answer: 810 spent
        assert keeper.has_headroom(scopes, 50)
        redis_server.stop()
        await keeper.admit(scopes, 1, "open")  # finds the store gone
        assert not keeper.has_headroom(scopes, 1)
