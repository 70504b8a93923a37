"""Requests waiting for a saturated model: per-tenant FIFOs served by weighted fair queuing,
better priority classes first, the worst class shed first when the model's bound is reached.

One FairQueue per model pool. The proxy owns the capacity accounting and this queue only asks:
`has_capacity(rank)` says whether some routable replica has room for a request of that rank
(rank: contract.tenancy.priority_rank, 0 the best). The proxy's side of the contract:
- acquire() returning means "go now": count the request against its replica before the next
  await, so that has_capacity already sees it when the queue grants the next waiter;
- done(ticket, actual_cost) once for every ticket acquire() returned, when the request ends;
- kick() whenever capacity may have appeared without a done() (a replica came, a bound rose).

Fairness is start-time fair queuing in tokens, per rank: each (rank, tenant) flow has a virtual
time, the start tag of its next request; the backlogged flow with the smallest one goes next and
advances it by cost/weight. A flow that becomes backlogged starts at no less than its rank's
virtual time (the start tag of the latest request dispatched), so idleness banks no credit. The
cost is an estimate at admission; done() corrects the flow by the difference, so shares are in
the tokens actually served.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

CLOSED_MESSAGE = "the model was removed"


class QueueFull(RuntimeError):
    """The model's queue is at its bound, or a better priority class took this waiter's place.
    `queued_s`: how long the request had waited (0 when refused on arrival)."""

    def __init__(self, message: str, queued_s: float = 0.0) -> None:
        super().__init__(message)
        self.queued_s = queued_s


class QueueTimeout(RuntimeError):
    """No capacity for the request within the queue's timeout."""

    def __init__(self, message: str, queued_s: float = 0.0) -> None:
        super().__init__(message)
        self.queued_s = queued_s


@dataclass(eq=False)
class Ticket:
    """A request allowed to go: what done() needs, and how long it waited (0 when it did not)."""

    tenant: str
    rank: int
    weight: int
    cost: float
    queued_s: float = 0.0
    settled: bool = field(default=False, init=False, repr=False)


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
    seq: int
    enqueued_at: float
    future: asyncio.Future[None]
    state: Literal["queued", "granted", "gone"] = "queued"
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Flow:
    """One tenant's waiters of one rank; vtime is the start tag of its next request."""

    vtime: float = 0.0
    waiters: deque[_Waiter] = field(default_factory=deque)


@dataclass(eq=False)
class _Rank:
    vtime: float = 0.0  # the start tag of the latest request dispatched at this rank
    num_queued: int = 0
    flows: dict[str, _Flow] = field(default_factory=dict)


class FairQueue:
    def __init__(
        self,
        has_capacity: Callable[[int], bool],
        *,
        max_queued: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_queued < 0:
            raise ValueError(f"max_queued must be 0 or more, not {max_queued}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s:g}")
        self._has_capacity = has_capacity
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._clock = clock
        self._ranks: dict[int, _Rank] = {}
        self._num_queued = 0
        # Waiters granted whose acquire() has not returned yet: the proxy has not counted them,
        # so has_capacity cannot see them; the next grant waits for them (see acquire).
        self._num_granting = 0
        self._seq = 0
        self._closed = False

    # ---- the proxy's calls ----

    async def acquire(self, tenant: str, rank: int, weight: int, cost: float) -> Ticket:
        """Return when the request may go: at once when there is capacity for its rank and no
        request of the same or a better rank waits; otherwise after waiting its turn. QueueFull
        when the queue is full (or a better class evicts it, or close()), QueueTimeout after
        timeout_s without capacity."""
        if rank < 0 or weight < 1 or cost < 0:
            raise ValueError(
                f"rank {rank}, weight {weight}, cost {cost:g}: rank and cost must be 0 or more, "
                "weight 1 or more"
            )
        if self._closed:
            raise QueueFull(CLOSED_MESSAGE)
        ticket = self.try_acquire(tenant, rank, weight, cost)
        if ticket is not None:
            return ticket
        ticket = Ticket(tenant, rank, weight, cost)
        self._make_room(rank)
        waiter = self._enqueue(*self._flow(rank, tenant), ticket)
        self.kick()
        try:
            await waiter.future
        except asyncio.CancelledError:
            self._withdraw(waiter)
            raise
        self._num_granting -= 1
        # The proxy counts this request before its next await; grant the next one after that.
        asyncio.get_running_loop().call_soon(self.kick)
        return ticket

    def try_acquire(self, tenant: str, rank: int, weight: int, cost: float) -> Ticket | None:
        """acquire()'s answer when it would return at once (capacity for the rank and nobody of
        the same or a better rank waiting); None when the request would have to wait (it is not
        queued: call acquire() for that)."""
        if (
            self._closed
            or self._num_granting
            or self._waiting_at_or_above(rank)
            or not self._has_capacity(rank)
        ):
            return None
        ticket = Ticket(tenant, rank, weight, cost)
        level, flow = self._flow(rank, tenant)
        flow.vtime = max(flow.vtime, level.vtime)
        self._advance(level, flow, ticket)
        return ticket

    def done(self, ticket: Ticket, actual_cost: float) -> None:
        """The request ended having cost actual_cost: correct its tenant's virtual time by the
        estimate's error, and let the freed capacity go to the next waiter. Once per ticket."""
        if ticket.settled:
            return
        ticket.settled = True
        flow = self._ranks[ticket.rank].flows[ticket.tenant]
        flow.vtime += (actual_cost - ticket.cost) / ticket.weight
        self.kick()

    def kick(self) -> None:
        """Grant the next waiter if there is capacity for it: the best rank first, within it the
        tenant with the smallest virtual time, ties by arrival. One grant at a time: the next
        follows when the granted request's acquire() has returned and the proxy counted it."""
        while self._num_queued and not self._num_granting:
            rank = min(r for r, level in self._ranks.items() if level.num_queued)
            if not self._has_capacity(rank):
                return
            level = self._ranks[rank]
            flow = min(
                (f for f in level.flows.values() if f.waiters),
                key=lambda f: (f.vtime, f.waiters[0].seq),
            )
            waiter = flow.waiters[0]
            self._remove(level, flow, waiter)
            if waiter.future.done():  # its task was cancelled and has not run since
                continue
            self._advance(level, flow, waiter.ticket)
            waiter.state = "granted"
            waiter.ticket.queued_s = self._clock() - waiter.enqueued_at
            self._num_granting += 1
            waiter.future.set_result(None)

    def close(self) -> None:
        """The model is gone: every waiter, and every later acquire(), gets QueueFull."""
        self._closed = True
        for level in self._ranks.values():
            for flow in level.flows.values():
                while flow.waiters:
                    self._fail(level, flow, flow.waiters[0], QueueFull, CLOSED_MESSAGE)

    # ---- observability ----

    def queued(self) -> int:
        return self._num_queued

    def queued_by_tenant(self) -> dict[str, int]:
        """Waiting requests per tenant, every tenant seen so far included (0 when none waits),
        so that a gauge per tenant drops back to 0."""
        counts: dict[str, int] = {}
        for level in self._ranks.values():
            for tenant, flow in level.flows.items():
                counts[tenant] = counts.get(tenant, 0) + len(flow.waiters)
        return counts

    def queued_by_rank(self) -> dict[int, int]:
        return {rank: level.num_queued for rank, level in sorted(self._ranks.items())}

    # ---- bookkeeping ----

    def _flow(self, rank: int, tenant: str) -> tuple[_Rank, _Flow]:
        level = self._ranks.setdefault(rank, _Rank())
        return level, level.flows.setdefault(tenant, _Flow())

    def _waiting_at_or_above(self, rank: int) -> bool:
        return any(r <= rank and level.num_queued for r, level in self._ranks.items())

    def _advance(self, level: _Rank, flow: _Flow, ticket: Ticket) -> None:
        level.vtime = max(level.vtime, flow.vtime)
        flow.vtime += ticket.cost / ticket.weight

    def _make_room(self, rank: int) -> None:
        """Raise QueueFull if the queue is full and nothing worse waits; else evict the most
        recently queued request of the worst rank waiting."""
        if self._num_queued < self.max_queued:
            return
        worst = max((r for r, level in self._ranks.items() if level.num_queued), default=None)
        if worst is None or rank >= worst:
            raise QueueFull(
                f"the model's queue is full ({self._num_queued} requests waiting); retry later"
            )
        level = self._ranks[worst]
        flow = max((f for f in level.flows.values() if f.waiters), key=lambda f: f.waiters[-1].seq)
        message = "a request of a higher priority class took this request's place in the queue"
        self._fail(level, flow, flow.waiters[-1], QueueFull, message)

    def _enqueue(self, level: _Rank, flow: _Flow, ticket: Ticket) -> _Waiter:
        loop = asyncio.get_running_loop()
        if not flow.waiters:
            flow.vtime = max(flow.vtime, level.vtime)
        waiter = _Waiter(ticket, self._seq, self._clock(), loop.create_future())
        self._seq += 1
        waiter.timer = loop.call_later(self.timeout_s, self._expire, ticket.rank, waiter)
        flow.waiters.append(waiter)
        level.num_queued += 1
        self._num_queued += 1
        return waiter

    def _expire(self, rank: int, waiter: _Waiter) -> None:
        if waiter.state != "queued":
            return
        level = self._ranks[rank]
        message = f"no capacity for this request within {self.timeout_s:g} s"
        self._fail(level, level.flows[waiter.ticket.tenant], waiter, QueueTimeout, message)

    def _fail(
        self,
        level: _Rank,
        flow: _Flow,
        waiter: _Waiter,
        error: type[QueueFull] | type[QueueTimeout],
        message: str,
    ) -> None:
        self._remove(level, flow, waiter)
        if not waiter.future.done():
            waiter.future.set_exception(error(message, self._clock() - waiter.enqueued_at))

    def _remove(self, level: _Rank, flow: _Flow, waiter: _Waiter) -> None:
        flow.waiters.remove(waiter)
        level.num_queued -= 1
        self._num_queued -= 1
        waiter.state = "gone"
        if waiter.timer is not None:
            waiter.timer.cancel()

    def _withdraw(self, waiter: _Waiter) -> None:
        """The waiter's task was cancelled (its client went away)."""
        ticket = waiter.ticket
        level = self._ranks[ticket.rank]
        flow = level.flows[ticket.tenant]
        if waiter.state == "queued":
            self._remove(level, flow, waiter)
        elif waiter.state == "granted":
            # Granted but never started: refund its tenant and pass the capacity on.
            waiter.state = "gone"
            self._num_granting -= 1
            flow.vtime -= ticket.cost / ticket.weight
            self.kick()
