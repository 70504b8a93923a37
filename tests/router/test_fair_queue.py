"""The router's per-model fair queue, exactly: when it lets a request go, in which order, how
it sheds and times out, and that weighted shares of tokens hold under saturation. Capacity is a
counter the test owns (as the proxy's replica slots are), completion is done()."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kvpilot.contract.kv_events import Load
from kvpilot.contract.tenancy import priority_rank
from kvpilot.router.fair_queue import FairQueue, QueueFull, QueueTimeout, Ticket
from kvpilot.router.index import BlockIndex
from kvpilot.router.replica import Replica

BEST = priority_rank("critical")
HIGH = priority_rank("high")
STANDARD = priority_rank("standard")
WORST = priority_rank("best-effort")


@dataclass
class Slots:
    """The proxy's side: `size` requests may run at once; one is counted as soon as acquire()
    returns, and freed by finish(), which calls done()."""

    size: int
    in_use: int = 0
    overflows: int = 0  # times the queue let a request go with no room for it
    started: list[Ticket] = field(default_factory=list)

    def has_capacity(self, rank: int) -> bool:
        return self.in_use < self.size

    async def go(self, queue: FairQueue, tenant: str, rank: int = STANDARD, cost: float = 1.0,
                 weight: int = 1) -> Ticket:  # fmt: skip
        ticket = await queue.acquire(tenant, rank, weight, cost)
        self.in_use += 1
        self.overflows += self.in_use > self.size
        self.started.append(ticket)
        return ticket

    def finish(self, queue: FairQueue, ticket: Ticket, actual_cost: float | None = None) -> None:
        self.in_use -= 1
        queue.done(ticket, ticket.cost if actual_cost is None else actual_cost)


def make(slots: Slots, max_queued: int = 100, timeout_s: float = 5.0, **kw) -> FairQueue:
    return FairQueue(slots.has_capacity, max_queued=max_queued, timeout_s=timeout_s, **kw)


async def settle() -> None:
    """Let every ready task run until none is (each grant takes a few loop turns)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def queue_up(slots: Slots, queue: FairQueue, *specs: tuple) -> list[asyncio.Task[Ticket]]:
    """Start one request per spec (tenant, rank[, cost[, weight]]), each queued before the next."""
    tasks = []
    for spec in specs:
        tasks.append(asyncio.create_task(slots.go(queue, *spec)))
        await settle()
    return tasks


def order(slots: Slots, first: int = 0) -> list[str]:
    return [f"{t.tenant}{t.rank}" for t in slots.started[first:]]


async def drain(slots: Slots, queue: FairQueue) -> None:
    """Finish the oldest running request until nothing runs or waits."""
    finished = 0
    while finished < len(slots.started):
        slots.finish(queue, slots.started[finished])
        finished += 1
        await settle()
    assert slots.overflows == 0


async def test_requests_go_at_once_while_there_is_capacity() -> None:
    slots = Slots(3)
    queue = make(slots)
    for tenant in "abc":
        ticket = await slots.go(queue, tenant)
        assert ticket.queued_s == 0.0
    assert queue.queued() == 0
    task = asyncio.create_task(slots.go(queue, "d"))
    await settle()
    assert not task.done() and queue.queued() == 1
    assert queue.queued_by_tenant() == {"a": 0, "b": 0, "c": 0, "d": 1}
    slots.finish(queue, slots.started[0])
    assert (await asyncio.wait_for(task, 1)).tenant == "d"
    assert queue.queued() == 0


async def test_each_tenant_is_served_in_its_own_arrival_order() -> None:
    slots = Slots(1)
    queue = make(slots)
    await slots.go(queue, "x")
    tasks = await queue_up(slots, queue, ("a", STANDARD, 5.0), ("a", STANDARD, 1.0),
                           ("a", STANDARD, 3.0))  # fmt: skip
    await drain(slots, queue)
    assert [t.cost for t in slots.started[1:]] == [5.0, 1.0, 3.0]
    assert [task.result() for task in tasks] == slots.started[1:]


async def test_a_better_rank_goes_first_and_waiters_are_not_overtaken() -> None:
    slots = Slots(1)
    queue = make(slots)
    await slots.go(queue, "x")
    await queue_up(slots, queue, ("a", WORST), ("b", STANDARD), ("c", WORST), ("d", BEST))
    assert queue.queued_by_rank() == {BEST: 1, STANDARD: 1, WORST: 2}
    # A slot appears (no kick yet) while a standard request waits: a new standard request does
    # not take it; the best waiter does.
    slots.size = 2
    late = asyncio.create_task(slots.go(queue, "e", STANDARD))
    await settle()
    assert order(slots, 1) == [f"d{BEST}"]
    assert not late.done()
    slots.size = 1
    await drain(slots, queue)
    assert order(slots, 1) == [f"d{BEST}", f"b{STANDARD}", f"e{STANDARD}", f"a{WORST}",
                               f"c{WORST}"]  # fmt: skip


async def test_a_better_rank_passes_worse_waiters_when_its_capacity_is_there() -> None:
    # The proxy keeps headroom for the best class: worse ranks see no capacity.
    in_use = 2
    queue = FairQueue(lambda rank: in_use < (3 if rank == BEST else 2), max_queued=10, timeout_s=30)
    waiting = asyncio.create_task(queue.acquire("a", WORST, 1, 1.0))
    await settle()
    ticket = await asyncio.wait_for(queue.acquire("b", BEST, 1, 1.0), 1)
    assert ticket.queued_s == 0.0 and not waiting.done()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert queue.queued() == 0


async def test_the_lowest_virtual_time_goes_next_and_queued_seconds_are_measured() -> None:
    now = [100.0]
    slots = Slots(1)
    queue = make(slots, clock=lambda: now[0])
    await slots.go(queue, "x")
    # a's requests cost 4 (weight 1), b's cost 1: b goes four times for each of a's.
    await queue_up(slots, queue, *[("a", STANDARD, 4.0)] * 3, *[("b", STANDARD, 1.0)] * 9)
    now[0] += 2.5
    await drain(slots, queue)
    assert "".join(t.tenant for t in slots.started[1:]) == "abbbbabbbbab"
    assert slots.started[1].queued_s == 2.5


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


@dataclass
class Tenant:
    name: str
    weight: int
    estimate: float  # prompt + max_tokens, what the proxy charges at admission
    actual: Callable[[random.Random], float]  # the tokens the request really took
    served: float = 0.0


async def saturate(tenants: list[Tenant], rounds: int, *, slots: int = 4, depth: int = 6,
                   seed: int = 7) -> dict[str, float]:  # fmt: skip
    """Every tenant keeps `depth` requests outstanding against `slots` slots; the oldest running
    request finishes each round. Returns each tenant's share of the tokens actually served,
    counted after a warm-up of one tenth of the rounds."""
    rng = random.Random(seed)
    capacity = Slots(slots)
    queue = make(capacity, max_queued=len(tenants) * depth)
    running: list[tuple[Tenant, Ticket]] = []

    async def client(tenant: Tenant) -> None:
        while True:
            ticket = await queue.acquire(tenant.name, STANDARD, tenant.weight, tenant.estimate)
            capacity.in_use += 1
            assert capacity.in_use <= slots, "more requests went than there is room for"
            running.append((tenant, ticket))

    clients = [asyncio.create_task(client(t)) for _ in range(depth) for t in tenants]
    await settle()
    for i in range(rounds):
        tenant, ticket = running.pop(0)
        actual = tenant.actual(rng)
        if i >= rounds // 10:
            tenant.served += actual
        capacity.in_use -= 1
        queue.done(ticket, actual)
        await settle()
    assert not any(task.done() for task in clients), "a client failed"
    for task in clients:
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    total = sum(t.served for t in tenants)
    return {t.name: t.served / total for t in tenants}


def three_tenants(weights: tuple[int, int, int]) -> list[Tenant]:
    # Unequal sizes, and estimates well above the real use (max_tokens is rarely reached).
    return [
        Tenant("chat", weights[0], 600.0, lambda r: r.uniform(50, 500)),
        Tenant("batch", weights[1], 2200.0, lambda r: r.uniform(1000, 2000)),
        Tenant("tiny", weights[2], 120.0, lambda r: r.uniform(10, 60)),
    ]


@pytest.mark.parametrize("weights", [(1, 1, 1), (2, 1, 1)])
async def test_token_shares_follow_weights_under_saturation(weights: tuple[int, int, int]) -> None:
    tenants = three_tenants(weights)
    shares = await saturate(tenants, rounds=1500)
    per_weight = [shares[t.name] / t.weight for t in tenants]
    assert jain(per_weight) >= 0.95, shares
    for tenant in tenants:
        assert shares[tenant.name] == pytest.approx(tenant.weight / sum(weights), rel=0.05), shares


async def test_an_idle_tenant_that_returns_gets_no_burst() -> None:
    slots = Slots(1)
    queue = make(slots)
    await slots.go(queue, "x")
    # a and b are served alone for a while; c was idle all that time.
    await queue_up(slots, queue, *[("a", STANDARD, 10.0)] * 20, *[("b", STANDARD, 10.0)] * 20)
    for i in range(20):
        slots.finish(queue, slots.started[i])
        await settle()
    first = len(slots.started)
    await queue_up(slots, queue, *[("c", STANDARD, 10.0)] * 20)
    for i in range(20, 32):
        slots.finish(queue, slots.started[i])
        await settle()
    # Banked credit would have served c twelve times in a row; it gets its third.
    after = "".join(t.tenant for t in slots.started[first:])
    assert sorted(after.count(t) for t in "abc") == [4, 4, 4], after


async def test_a_full_queue_sheds_the_worst_rank_newest_first() -> None:
    slots = Slots(1)
    queue = make(slots, max_queued=3)
    await slots.go(queue, "x")
    older, newer, standard = await queue_up(slots, queue, ("a", WORST), ("b", WORST),
                                            ("c", STANDARD))  # fmt: skip
    better = asyncio.create_task(slots.go(queue, "d", HIGH))
    await settle()
    with pytest.raises(QueueFull, match="higher priority") as evicted:
        await newer
    assert evicted.value.queued_s >= 0.0
    assert queue.queued_by_rank()[WORST] == 1 and queue.queued() == 3
    with pytest.raises(QueueFull, match="queue is full"):
        await queue.acquire("e", WORST, 1, 1.0)
    assert queue.queued() == 3 and not older.done()
    await drain(slots, queue)
    assert order(slots, 1) == [f"d{HIGH}", f"c{STANDARD}", f"a{WORST}"]
    assert standard.done() and better.done()


async def test_an_equal_rank_is_refused_when_full() -> None:
    slots = Slots(0)
    queue = make(slots, max_queued=2)
    tasks = await queue_up(slots, queue, ("a", STANDARD), ("b", HIGH))
    with pytest.raises(QueueFull) as refused:
        await queue.acquire("c", STANDARD, 1, 1.0)
    assert refused.value.queued_s == 0.0 and "c" not in queue.queued_by_tenant()
    assert queue.queued() == 2 and not any(t.done() for t in tasks)
    queue.close()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_waiter_times_out_and_leaves_the_queue() -> None:
    slots = Slots(0)
    queue = make(slots, timeout_s=0.05)
    with pytest.raises(QueueTimeout, match=r"within 0\.05 s") as timed_out:
        await queue.acquire("a", STANDARD, 1, 1.0)
    assert timed_out.value.queued_s >= 0.04
    assert queue.queued() == 0 and queue.queued_by_tenant() == {"a": 0}


async def test_a_cancelled_waiter_leaves_without_disturbing_others() -> None:
    slots = Slots(1)
    queue = make(slots)
    await slots.go(queue, "x")
    b = (await queue_up(slots, queue, ("a", STANDARD), ("b", STANDARD), ("c", STANDARD)))[1]
    b.cancel()
    await settle()
    assert b.cancelled() and queue.queued() == 2
    await drain(slots, queue)
    assert order(slots, 1) == [f"a{STANDARD}", f"c{STANDARD}"]
    assert slots.in_use == 0 and queue.queued() == 0


async def test_a_waiter_cancelled_as_it_is_granted_passes_its_slot_on() -> None:
    slots = Slots(1)
    queue = make(slots)
    first = await slots.go(queue, "x")
    a, b = await queue_up(slots, queue, ("a", STANDARD), ("b", STANDARD))
    # The slot is granted to a, and a's client goes away before a's task runs again.
    slots.finish(queue, first)
    a.cancel()
    ticket = await asyncio.wait_for(b, 1)
    assert ticket.tenant == "b" and a.cancelled()
    assert slots.in_use == 1 and queue.queued() == 0


async def test_a_waiter_cancelled_before_the_grant_is_skipped() -> None:
    slots = Slots(1)
    queue = make(slots)
    first = await slots.go(queue, "x")
    a, b = await queue_up(slots, queue, ("a", STANDARD), ("b", STANDARD))
    # a's task is cancelled but has not run yet when the slot frees.
    a.cancel()
    slots.finish(queue, first)
    assert (await asyncio.wait_for(b, 1)).tenant == "b"
    with pytest.raises(asyncio.CancelledError):
        await a
    assert queue.queued() == 0


async def test_close_wakes_every_waiter_and_refuses_later_requests() -> None:
    slots = Slots(0)
    queue = make(slots)
    tasks = await queue_up(slots, queue, ("a", STANDARD), ("b", BEST), ("c", WORST))
    queue.close()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, QueueFull) and str(r) == "the model was removed" for r in results)
    with pytest.raises(QueueFull, match="removed"):
        await queue.acquire("d", BEST, 1, 1.0)
    assert queue.queued() == 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        FairQueue(lambda rank: True, max_queued=1, timeout_s=0)
    with pytest.raises(ValueError, match="max_queued"):
        FairQueue(lambda rank: True, max_queued=-1, timeout_s=1)


async def test_a_weight_below_one_is_refused() -> None:
    queue = FairQueue(lambda rank: True, max_queued=1, timeout_s=1)
    with pytest.raises(ValueError, match="weight 0"):
        await queue.acquire("a", STANDARD, 0, 1.0)


def test_a_replicas_room_per_rank_under_a_replica_concurrency() -> None:
    """What has_capacity asks of each replica: a class counts itself and the better ones, never
    the worse; `concurrency` bounds the classes below the best, and the best class only the
    engine's max_num_seqs (its own requests do not queue it behind themselves)."""
    replica = Replica("r", "http://r", BlockIndex(8), load=Load(max_num_seqs=16))
    replica.in_flight_by_rank[BEST] = 4
    assert replica.has_room(BEST, 4, 32)  # 4 of its own, the engine runs 16
    assert not replica.has_room(WORST, 4, 32)  # 4 better ones in flight: at its bound
    replica.in_flight_by_rank[BEST] = 2
    replica.in_flight_by_rank[WORST] = 1
    assert replica.has_room(WORST, 4, 32) and replica.has_room(HIGH, 4, 32)
    replica.in_flight_by_rank[WORST] = 2
    assert not replica.has_room(WORST, 4, 32) and replica.has_room(HIGH, 4, 32)
    replica.in_flight_by_rank[BEST] = 16
    assert not replica.has_room(BEST, 4, 32)  # the engine's own bound
    # Without a concurrency every class is bounded by the engine; without its report, the default.
    replica.in_flight_by_rank[BEST] = 14
    replica.in_flight_by_rank[WORST] = 0
    replica.in_flight_by_rank[STANDARD] = 1
    assert replica.has_room(STANDARD, None, 32)
    replica.in_flight_by_rank[STANDARD] = 2
    assert not replica.has_room(STANDARD, None, 32) and replica.has_room(BEST, None, 32)
    unknown = Replica("u", "http://u", BlockIndex(8))
    unknown.in_flight_by_rank[STANDARD] = 31
    assert unknown.has_room(STANDARD, None, 32) and not unknown.has_room(WORST, 4, 32)
