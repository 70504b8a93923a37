"""The quota keeper: admits a tenant's requests against its scopes' quotas and counts their use,
in Redis shared by every router, or in this router alone.

With a shared store, every admission, charge and settle is one round trip to it; what it admits
is mirrored into a local store, so that this router's own use is known without it. When the
shared store cannot be reached, each tenant's setting decides: `open` lets the local store
decide (the budget this router alone can see), `closed` refuses with `store_unavailable`. While
the store is down no request waits on it: a background probe finds it back. (Failing open can
overshoot by the admissions that were on their way to the store when it died: the local count
learns of them only from the store's answer.)

With a shared store a router may also go ahead before the store's answer (has_headroom(): the
proxy forwards the request while its admission is on its way and passes nothing back before the
answer; one the store refuses is cancelled and answered 429). That hides the round trip behind
the replica's own time without admitting anything the store did not: the store counts and
refuses exactly as before, and nothing of a refused request reaches its client. What a refused
speculation can cost is replica work never served; a router speculates only while its last
answers from the store (this window's, plus its own admissions still on their way) leave at
least HEADROOM of every limit after the request, so the refused ones are those in flight while
other routers spent that much of the budget between two answers of this router's: a tenant
near or over its quota is checked before it reaches a replica.

Concurrency leases live `lease_ttl_s` unless renewed; the keeper renews those of its requests in
flight every third of that, so the leases of a router that died free themselves within the ttl.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.contract.tenancy import StoreFailure
from kvpilot.router.quota.decision import Decision, build_decision, store_unavailable
from kvpilot.router.quota.local_store import LocalQuotaStore
from kvpilot.router.quota.model import Lease, Scope, Usage, window_index
from kvpilot.router.quota.redis_store import DEFAULT_KEY_PREFIX, STORE_ERRORS, RedisQuotaStore

log = logging.getLogger("kvpilot.router.quota")

DEFAULT_LEASE_TTL_S = 30.0
DEFAULT_PROBE_INTERVAL_S = 0.5
# The share of every limit a router's view of the store must leave after a request for it to go
# ahead before the store's answer.
HEADROOM = 0.1


@dataclass
class _Flight:
    lease: Lease
    prompt: int  # the prompt tokens its admission charged
    window: int  # the window they were charged in
    charged: int = 0  # completion tokens charged since


class QuotaKeeper:
    """Quotas of every tenant, for one router. `redis_url` None: this router alone (local store).
    `clock` gives the time that windows and lease expiries are reckoned in."""

    def __init__(
        self,
        redis_url: str | None,
        *,
        clock: Callable[[], float] = time.time,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
    ) -> None:
        if lease_ttl_s <= 0 or probe_interval_s <= 0:
            raise ValueError("lease_ttl_s and probe_interval_s must be positive")
        self._shared = RedisQuotaStore(redis_url, key_prefix=key_prefix) if redis_url else None
        self._local = LocalQuotaStore()
        self._clock = clock
        self._lease_ttl_s = lease_ttl_s
        self._probe_interval_s = probe_interval_s
        self._flights: dict[str, _Flight] = {}
        # Lease ids: unique across routers by this keeper's random prefix, then a count.
        self._lease_prefix = uuid.uuid4().hex[:16] + "-"
        self._lease_numbers = itertools.count()
        self._store_up = True
        self._up = asyncio.Event()
        self._up.set()
        self._renewer: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        # The shared store's answers to settles and charges under way; stop() waits for them.
        self._settling: set[asyncio.Future[Any]] = set()
        # Per scope: its usage in the store's last answer (with the answer's window), and the
        # requests and tokens of this router's admissions on their way to the store.
        self._seen: dict[str, tuple[int, Usage]] = {}
        self._pending: dict[str, list[int]] = {}

    @property
    def store_up(self) -> bool:
        """Whether the shared store answers (True without one: the local store never fails)."""
        return self._store_up

    async def wait_store_up(self) -> None:
        """Return once the shared store answers again."""
        await self._up.wait()

    async def start(self) -> None:
        """Check the shared store and start renewing leases. An unreachable store does not stop
        the start: the keeper runs on its fallback until the store answers."""
        if self._shared is not None:
            try:
                await self._shared.ping()
            except STORE_ERRORS as error:
                self._mark_down(error)
        self._renewer = asyncio.create_task(self._renew_forever(), name="quota-lease-renewer")

    async def stop(self) -> None:
        """Finish the settles under way, stop renewing and close the store. Leases still in
        flight (never settled) expire after the ttl."""
        if self._settling:
            await asyncio.wait(self._settling)
        for task in (self._renewer, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._renewer = self._prober = None
        if self._shared is not None:
            await self._shared.close()

    async def admit(
        self, scopes: Sequence[Scope], prompt_tokens: int, on_store_failure: StoreFailure
    ) -> Decision:
        """Admit a request if every scope's quota has room for it (one more request, its prompt
        tokens, one more in flight), charging all of them in the same atomic step; refuse it
        and charge none otherwise. Scopes without a limit are not counted; a request with none
        costs nothing (no store is touched, the lease is None)."""
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        limited = [scope for scope in scopes if scope.quota.is_limited]
        if len({scope.key for scope in limited}) != len(limited):
            raise ValueError("a request's scopes must have distinct keys")
        if not limited:
            return Decision(admitted=True)
        now = self._clock()
        lease_id = f"{self._lease_prefix}{next(self._lease_numbers)}"
        expiry = now + self._lease_ttl_s
        keys = tuple(scope.key for scope in limited)
        if self._shared is not None and self._store_up:
            self._add_pending(keys, 1, prompt_tokens)
            try:
                verdict = await self._shared.admit(limited, prompt_tokens, lease_id, now, expiry)
            except STORE_ERRORS as error:
                self._mark_down(error)
            else:
                window = window_index(now)
                for key, used in zip(keys, verdict.usage, strict=True):
                    self._seen[key] = (window, used)
                lease = None
                if verdict.refused_kind is None:
                    self._local.admit(limited, prompt_tokens, lease_id, now, expiry, check=False)
                    lease = self._hold(Lease(lease_id, keys, "shared"), prompt_tokens, now)
                return build_decision(limited, prompt_tokens, verdict, now, lease)
            finally:
                self._add_pending(keys, -1, -prompt_tokens)
        if self._shared is not None and on_store_failure == "closed":
            return store_unavailable()
        verdict = self._local.admit(limited, prompt_tokens, lease_id, now, expiry)
        lease = None
        if verdict.refused_kind is None:
            lease = self._hold(Lease(lease_id, keys, "local"), prompt_tokens, now)
        return build_decision(limited, prompt_tokens, verdict, now, lease)

    def has_headroom(self, scopes: Sequence[Scope], prompt_tokens: int) -> bool:
        """Whether a request may go ahead before the shared store answers its admission (see
        the module's docstring): the store is up, and by its last answers in this window plus
        this router's admissions on their way, every limited scope keeps HEADROOM of each
        limit after this request. False without a shared store (nothing to wait for) and for
        a scope the store has not answered for in this window."""
        if self._shared is None or not self._store_up:
            return False
        window = window_index(self._clock())
        for scope in scopes:
            quota = scope.quota
            if not quota.is_limited:
                continue
            seen = self._seen.get(scope.key)
            if seen is None or seen[0] != window:
                return False
            used = seen[1]
            requests, tokens = self._pending.get(scope.key, (0, 0))
            wanted = (
                (quota.requests_per_minute, used.requests + requests + 1),
                (quota.tokens_per_minute, used.tokens + tokens + prompt_tokens),
                (quota.max_concurrent, used.concurrent + requests + 1),
            )
            for limit, after in wanted:
                if limit is not None and after > limit * (1 - HEADROOM):
                    return False
        return True

    def _add_pending(self, keys: Sequence[str], requests: int, tokens: int) -> None:
        for key in keys:
            counts = self._pending.setdefault(key, [0, 0])
            counts[0] += requests
            counts[1] += tokens
            if counts[0] == 0:
                del self._pending[key]

    async def charge(self, lease: Lease | None, tokens: int) -> None:
        """Add completion tokens (as they stream) to every scope of the lease, in the window of
        now. Nothing for a lease already settled or None."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        flight = None if lease is None else self._flights.get(lease.id)
        if flight is None or tokens == 0:
            return
        flight.charged += tokens
        await _answer(self._finish(flight.lease, tokens, release=False))

    async def settle(
        self, lease: Lease | None, completion_tokens: int, prompt_tokens: int | None = None
    ) -> None:
        """settle_soon(), then wait for the shared store's answer. The store takes the settle
        even if the caller is cancelled (the client went away)."""
        await _answer(self.settle_soon(lease, completion_tokens, prompt_tokens))

    def settle_soon(
        self, lease: Lease | None, completion_tokens: int, prompt_tokens: int | None = None
    ) -> asyncio.Future[Any] | None:
        """The request is over: charge what `completion_tokens` (its true total) adds to what
        charge() already did (never less), correct the prompt's charge to `prompt_tokens` (the
        prompt really served: 0 for a request that never was, which refunds it; None: as
        charged), and release its concurrency. A refund is taken back only while the window it
        was charged in lasts (a past window's count no longer limits anyone). A second settle of
        the same lease does nothing. The local count is settled on return and the shared
        store's command is on its way (no task): the Future of its answer, or None without one.
        A failed answer marks the store down; nobody needs to await it."""
        if prompt_tokens is not None and prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        flight = None if lease is None else self._flights.pop(lease.id, None)
        if flight is None:
            return None
        extra = max(0, completion_tokens - flight.charged)
        if prompt_tokens is not None:
            correction = prompt_tokens - flight.prompt
            if correction > 0 or window_index(self._clock()) == flight.window:
                extra += correction
        return self._finish(flight.lease, extra, release=True)

    async def usage(self, scope_key: str) -> Usage:
        """A scope's use in the current window: from the shared store while it answers, else
        what this router alone counted. Zero for a scope without a limit (it is not counted)."""
        now = self._clock()
        if self._shared is not None and self._store_up:
            try:
                return await self._shared.usage(scope_key, now)
            except STORE_ERRORS as error:
                self._mark_down(error)
        return self._local.usage(scope_key, now)

    def _hold(self, lease: Lease, prompt_tokens: int, now: float) -> Lease:
        self._flights[lease.id] = _Flight(lease, prompt_tokens, window_index(now))
        return lease

    def _finish(self, lease: Lease, tokens: int, *, release: bool) -> asyncio.Future[Any] | None:
        """Count on the local store now; send to the shared store, and return its answer's
        Future (None when the lease is not the shared store's or the store is down)."""
        now = self._clock()
        lease_id = lease.id if release else None
        # The local store counts every lease: it is the home of some, the mirror of the others.
        self._local.finish(lease.scope_keys, lease_id, tokens, now)
        if lease.home != "shared" or self._shared is None or not self._store_up:
            # A lease the store does not hear released expires with its ttl (no renewal).
            return None
        try:
            sent = self._shared.finish(lease.scope_keys, lease_id, tokens, now)
        except STORE_ERRORS as error:
            self._mark_down(error)
            return None
        self._settling.add(sent)
        sent.add_done_callback(self._answered)
        return sent

    def _answered(self, sent: asyncio.Future[Any]) -> None:
        self._settling.discard(sent)
        error = None if sent.cancelled() else sent.exception()
        if isinstance(error, STORE_ERRORS):
            self._mark_down(error)
        elif error is not None:
            log.error("the quota store's answer to a settle", exc_info=error)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ttl_s / 3)
            await self._renew()

    async def _renew(self) -> None:
        flights = list(self._flights.values())
        if not flights:
            return
        now = self._clock()
        expiry = now + self._lease_ttl_s
        self._local.renew([(f.lease.scope_keys, f.lease.id) for f in flights], now, expiry)
        shared = [(f.lease.scope_keys, f.lease.id) for f in flights if f.lease.home == "shared"]
        if not shared or self._shared is None or not self._store_up:
            return
        try:
            await self._shared.renew(shared, now, expiry)
            # A request settled while the renewal was on its way was written back: drop it.
            settled = [
                (keys, lease_id) for keys, lease_id in shared if lease_id not in self._flights
            ]
            if settled:
                await self._shared.drop(settled)
        except STORE_ERRORS as error:
            self._mark_down(error)

    def _mark_down(self, error: BaseException) -> None:
        if not self._store_up:
            return
        self._store_up = False
        self._up.clear()
        log.warning(
            "quota store unreachable (%s: %s): tenants that fail open are counted by this "
            "router alone, tenants that fail closed are refused until it answers",
            type(error).__name__,
            error,
        )
        self._prober = asyncio.create_task(self._probe_until_up(), name="quota-store-probe")

    async def _probe_until_up(self) -> None:
        assert self._shared is not None  # only a shared store goes down
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                await self._shared.ping()
            except STORE_ERRORS:
                continue
            self._store_up = True
            self._up.set()
            log.info("quota store reachable again: quotas are shared by every router")
            return


async def _answer(sent: asyncio.Future[Any] | None) -> None:
    """Wait for a store command's answer; a failure was dealt with when it came (the store is
    marked down), and the command stays on its way if the waiter is cancelled."""
    if sent is not None:
        with contextlib.suppress(*STORE_ERRORS):
            await asyncio.shield(sent)
