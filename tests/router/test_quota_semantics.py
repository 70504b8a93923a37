"""The quota keeper's semantics, the same on both stores: the shared one (a real redis-server)
and the local one (a router without Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvpilot.contract.tenancy import (
    LIMIT_REQUESTS,
    LIMIT_TOKENS,
    QUOTA_WINDOW_S,
    REMAINING_REQUESTS,
    REMAINING_TOKENS,
    RESET_REQUESTS,
    RESET_TOKENS,
    Quota,
)
from kvpilot.router.quota import QuotaKeeper, Scope, Usage, model_scope_key, tenant_scope_key

from ..redis_server import RedisServer

TENANT = tenant_scope_key("team-a", "chat")
MODEL = model_scope_key("team-a", "chat", "llama")
OTHER_MODEL = model_scope_key("team-a", "chat", "qwen")


class FakeClock:
    """Time the test moves: 10 s into a window, so the window ends in 50 s."""

    def __init__(self) -> None:
        self.now = 1_000_000 * QUOTA_WINDOW_S + 10.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["local", "redis"])
async def keeper(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> AsyncIterator[QuotaKeeper]:
    url = None
    if request.param == "redis":
        server = RedisServer(tmp_path)
        server.start()
        request.addfinalizer(server.stop)
        url = server.url
    keeper = QuotaKeeper(url, clock=clock)
    await keeper.start()
    yield keeper
    await keeper.stop()


async def test_requests_per_minute_refuses_until_the_window_rolls_over(
    keeper: QuotaKeeper, clock: FakeClock
) -> None:
    scopes = [Scope(TENANT, Quota(requests_per_minute=3))]
    for remaining in ("2", "1", "0"):
        decision = await keeper.admit(scopes, 10, "open")
        assert decision.admitted and decision.lease is not None
        assert decision.headers == {
            LIMIT_REQUESTS: "3",
            REMAINING_REQUESTS: remaining,
            RESET_REQUESTS: "50s",
        }
    refused = await keeper.admit(scopes, 10, "open")
    assert not refused.admitted and refused.lease is None
    assert refused.reason == "requests_per_minute"
    assert refused.retry_after_s == pytest.approx(50.0)
    assert refused.headers[REMAINING_REQUESTS] == "0"
    assert "3 requests per minute" in refused.message
    assert await keeper.usage(TENANT) == Usage(requests=3, tokens=30, concurrent=3)

    clock.now += 50.0  # the next window: its counters start from nothing
    again = await keeper.admit(scopes, 10, "open")
    assert again.admitted
    assert again.headers[REMAINING_REQUESTS] == "2"
    assert again.headers[RESET_REQUESTS] == "1m0s"
    usage = await keeper.usage(TENANT)
    assert (usage.requests, usage.tokens) == (1, 10)


async def test_the_prompt_must_fit_the_tokens_left(keeper: QuotaKeeper) -> None:
    scopes = [Scope(TENANT, Quota(tokens_per_minute=100))]
    assert (await keeper.admit(scopes, 60, "open")).admitted
    exact = await keeper.admit(scopes, 40, "open")
    assert exact.admitted
    assert exact.headers == {LIMIT_TOKENS: "100", REMAINING_TOKENS: "0", RESET_TOKENS: "50s"}
    refused = await keeper.admit(scopes, 1, "open")
    assert refused.reason == "tokens_per_minute"
    assert refused.retry_after_s == pytest.approx(50.0)
    assert "0 of its 100 tokens per minute" in refused.message
    assert "never" not in refused.message
    usage = await keeper.usage(TENANT)
    assert (usage.requests, usage.tokens) == (2, 100)


async def test_a_prompt_over_the_whole_budget_is_told_it_never_fits(keeper: QuotaKeeper) -> None:
    scopes = [Scope(TENANT, Quota(tokens_per_minute=100))]
    refused = await keeper.admit(scopes, 101, "open")
    assert refused.reason == "tokens_per_minute"
    assert "101 tokens" in refused.message and "never be admitted" in refused.message
    assert refused.headers[REMAINING_TOKENS] == "100"  # nothing was charged
    assert await keeper.usage(TENANT) == Usage()


async def test_concurrency_is_held_until_settled(keeper: QuotaKeeper) -> None:
    scopes = [Scope(TENANT, Quota(max_concurrent=2))]
    first = await keeper.admit(scopes, 5, "open")
    second = await keeper.admit(scopes, 5, "open")
    assert first.admitted and second.admitted
    assert first.headers == {}  # no window limit: no rate-limit headers
    refused = await keeper.admit(scopes, 5, "open")
    assert refused.reason == "concurrency"
    assert refused.retry_after_s == 1.0
    assert "2 of at most 2 requests in flight" in refused.message
    assert (await keeper.usage(TENANT)).concurrent == 2

    await keeper.settle(first.lease, 0)
    assert (await keeper.usage(TENANT)).concurrent == 1
    assert (await keeper.admit(scopes, 5, "open")).admitted


async def test_charge_and_settle_count_completion_tokens_once(keeper: QuotaKeeper) -> None:
    scopes = [Scope(TENANT, Quota(tokens_per_minute=1000))]
    lease = (await keeper.admit(scopes, 100, "open")).lease
    await keeper.charge(lease, 30)
    await keeper.charge(lease, 20)
    assert await keeper.usage(TENANT) == Usage(requests=1, tokens=150, concurrent=1)
    await keeper.settle(lease, 80)  # the true total: 30 more than streamed
    assert await keeper.usage(TENANT) == Usage(requests=1, tokens=180, concurrent=0)
    await keeper.settle(lease, 500)  # a second settle is a no-op
    await keeper.charge(lease, 7)  # so is a charge after the settle
    assert await keeper.usage(TENANT) == Usage(requests=1, tokens=180, concurrent=0)

    other = (await keeper.admit(scopes, 10, "open")).lease
    await keeper.charge(other, 50)
    await keeper.settle(other, 20)  # less than already charged: nothing taken back
    assert (await keeper.usage(TENANT)).tokens == 240


async def test_settle_corrects_the_prompt_to_what_was_served(
    keeper: QuotaKeeper, clock: FakeClock
) -> None:
    scopes = [Scope(TENANT, Quota(tokens_per_minute=1000))]
    never_served = (await keeper.admit(scopes, 100, "open")).lease
    await keeper.settle(never_served, 0, prompt_tokens=0)  # shed or refused: its prompt back
    assert await keeper.usage(TENANT) == Usage(requests=1, tokens=0, concurrent=0)

    counted_more = (await keeper.admit(scopes, 100, "open")).lease
    await keeper.settle(counted_more, 5, prompt_tokens=120)  # the engine counted 120
    assert (await keeper.usage(TENANT)).tokens == 125

    late = (await keeper.admit(scopes, 100, "open")).lease
    clock.now += QUOTA_WINDOW_S  # the next window: the last one's count limits nobody now
    await keeper.settle(late, 0, prompt_tokens=0)
    assert (await keeper.usage(TENANT)).tokens == 0
    with pytest.raises(ValueError, match="prompt_tokens"):
        await keeper.settle(late, 0, prompt_tokens=-1)


async def test_a_refusal_by_one_scope_charges_none(keeper: QuotaKeeper) -> None:
    tenant = Scope(TENANT, Quota(requests_per_minute=10, tokens_per_minute=1000))
    llama = Scope(MODEL, Quota(tokens_per_minute=100))
    qwen = Scope(OTHER_MODEL, Quota(tokens_per_minute=100))
    assert (await keeper.admit([tenant, llama], 80, "open")).admitted
    refused = await keeper.admit([tenant, llama], 30, "open")
    assert refused.reason == "tokens_per_minute"
    assert "for model llama" in refused.message
    assert await keeper.usage(TENANT) == Usage(requests=1, tokens=80, concurrent=1)
    assert await keeper.usage(MODEL) == Usage(requests=1, tokens=80, concurrent=1)

    assert (await keeper.admit([tenant, qwen], 30, "open")).admitted
    assert await keeper.usage(TENANT) == Usage(requests=2, tokens=110, concurrent=2)
    assert (await keeper.usage(MODEL)).tokens == 80

    # The tenant's total refuses now; the model scope is left as it was.
    small = Scope(TENANT, Quota(tokens_per_minute=120))
    refused = await keeper.admit([small, qwen], 20, "open")
    assert refused.reason == "tokens_per_minute"
    assert "model" not in refused.message
    assert await keeper.usage(OTHER_MODEL) == Usage(requests=1, tokens=30, concurrent=1)


async def test_headers_come_from_the_tightest_scope_of_each_kind(keeper: QuotaKeeper) -> None:
    tenant = Scope(TENANT, Quota(requests_per_minute=100, tokens_per_minute=1000))
    model = Scope(MODEL, Quota(requests_per_minute=5, tokens_per_minute=5000))
    decision = await keeper.admit([tenant, model], 200, "open")
    assert decision.headers == {
        LIMIT_REQUESTS: "5",
        REMAINING_REQUESTS: "4",
        RESET_REQUESTS: "50s",
        LIMIT_TOKENS: "1000",
        REMAINING_TOKENS: "800",
        RESET_TOKENS: "50s",
    }


async def test_a_request_without_limits_costs_nothing(keeper: QuotaKeeper) -> None:
    decision = await keeper.admit([Scope(TENANT, Quota()), Scope(MODEL, Quota())], 10, "closed")
    assert decision.admitted and decision.lease is None and decision.headers == {}
    await keeper.charge(None, 10)
    await keeper.settle(None, 10)
    assert await keeper.usage(TENANT) == Usage()


async def test_concurrent_admissions_never_overspend(keeper: QuotaKeeper) -> None:
    scopes = [Scope(TENANT, Quota(tokens_per_minute=700))]
    decisions = await asyncio.gather(*(keeper.admit(scopes, 7, "open") for _ in range(200)))
    assert sum(d.admitted for d in decisions) == 100
    assert {d.reason for d in decisions if not d.admitted} == {"tokens_per_minute"}
    assert (await keeper.usage(TENANT)).tokens == 700


async def test_bad_counts_are_refused_with_a_clear_error(keeper: QuotaKeeper) -> None:
    scopes = [Scope(TENANT, Quota(tokens_per_minute=100))]
    with pytest.raises(ValueError, match="prompt_tokens"):
        await keeper.admit(scopes, -1, "open")
    with pytest.raises(ValueError, match="distinct"):
        await keeper.admit(scopes * 2, 1, "open")
    lease = (await keeper.admit(scopes, 1, "open")).lease
    with pytest.raises(ValueError, match="tokens"):
        await keeper.charge(lease, -5)
