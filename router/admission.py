"""A tenant's request from its key to its turn: who it is (401), whether it may use the model
(403), whether its quotas admit it (429, or 503 when the shared store is down and the tenant
fails closed), and when a replica has room for it (the model's fair queue; 429 when shed or
timed out). Then, once answered, what it used: the tokens settle the quota, the fair queue's
virtual time and the tenant's counters.

The order is the issue's promise to tenants: nothing about a model is revealed before the key and
the grant are checked, and a request refused by its quota never waits in a queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract import errors
from kvpilot.contract.tenancy import PRIORITY_CLASSES, TENANT_HEADER, tenant_salt
from kvpilot.router.config import TenancyConfig
from kvpilot.router.fair_queue import FairQueue, QueueFull, QueueTimeout, Ticket
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.prompts import ParsedRequest
from kvpilot.router.quota import Decision, Lease, QuotaKeeper
from kvpilot.router.tenants import Tenant, TenantDirectory, check_grant, presented_key
from kvpilot.router.usage_meter import Usage

log = logging.getLogger("kvpilot.router")

# Engine priorities by rank (best first).
ENGINE_PRIORITIES = tuple(PRIORITY_CLASSES.values())

# Retry-After for a request shed from a full queue or timed out in it: the queue is saturated
# now; a second later it may not be.
_SHED_RETRY_S = 1


@dataclass
class Admitted:
    """A request the gate let through: what settles it at the end."""

    tenant: Tenant
    model: str  # the `model` id it named
    prompt_tokens: int
    lease: Lease | None
    ticket: Ticket | None
    fair: FairQueue | None
    # x-ratelimit-* and the tenant's name: on the response whatever its status.
    headers: dict[str, str] = field(default_factory=dict)
    charged_tokens: int = 0  # completion tokens charged while it streamed
    finished: bool = False
    # The engine priority of a better class recently active on the model (None: none).
    guard_priority: int | None = None
    # A request that went ahead before its quota's answer: the admission on its way (confirm()
    # awaits it before anything is passed back). None: decided before it went.
    verdict: asyncio.Future[Decision] | None = None

    def body_fields(self, parsed: ParsedRequest, shared_tokens: int) -> dict[str, Any]:
        """What the router sets on the forwarded body (router.forwarded_body)."""
        request = parsed.request
        fields: dict[str, Any] = {
            "priority": self.tenant.engine_priority,
            "cache_salt": self.salt(request.cache_salt),
        }
        if shared_tokens:
            fields["kvpilot_shared_prefix_tokens"] = shared_tokens
        if self.guard_priority is not None:
            fields["kvpilot_guard_priority"] = self.guard_priority
        if request.stream:
            # Every stream ends with the engine's usage: the quota settles on it (the chunk
            # goes on only to clients that asked for it: router.usage_meter).
            fields["stream_options"] = {"include_usage": True}
        return fields

    def salt(self, client_salt: str | None) -> str:
        return tenant_salt(self.tenant.namespace, self.tenant.name, client_salt)


def quota_refused(reason: str, message: str, headers: Mapping[str, str]) -> errors.APIError:
    """OpenAI's answers: 429 `rate_limit_exceeded` of type `tokens` or `requests`; 503 when the
    store is down for a tenant that fails closed."""
    if reason == "store_unavailable":
        return errors.APIError(
            503, message, type="api_error", code="quota_store_unavailable", headers=dict(headers)
        )
    kind = "tokens" if reason == "tokens_per_minute" else "requests"
    return errors.APIError(
        429, message, type=kind, code="rate_limit_exceeded", headers=dict(headers)
    )


class Admission:
    def __init__(
        self,
        config: TenancyConfig,
        directory: TenantDirectory,
        keeper: QuotaKeeper,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.directory = directory
        self.keeper = keeper
        self.metrics = metrics
        # Per model's fair queue: when a request of each class (by rank) was last admitted.
        self._active: weakref.WeakKeyDictionary[FairQueue, list[float]] = (
            weakref.WeakKeyDictionary()
        )

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        """The request's tenant by its key (401 otherwise): asked before anything else."""
        try:
            return self.directory.authenticate(dict(headers))
        except errors.APIError:
            reason = "missing_key" if presented_key(dict(headers)) is None else "unknown_key"
            self.metrics.tenant_rejections.labels("", reason).inc()
            raise

    def check_grant(self, tenant: Tenant, model: str) -> None:
        """403 unless the tenant's grants match `model` (before it is looked up)."""
        try:
            check_grant(tenant, model)
        except errors.APIError:
            self.metrics.tenant_rejections.labels(tenant.key, "not_granted").inc()
            raise

    async def admit(
        self,
        tenant: Tenant,
        model: str,
        parsed: ParsedRequest,
        prompt_tokens: int,
        fair: FairQueue | None,
        held: Any = None,
    ) -> Admitted:
        """Charge the quota, then wait for the fair queue's turn. Raises the 429/503. `held`:
        the model's held-requests gauge child, which counts the wait too (the operator's
        autoscaler adds it to the model's queue: a queue at the router is a queue).

        A request that can go at once (the fair queue has room for it) and whose quota has
        headroom (QuotaKeeper.has_headroom) returns before the quota's answer, with its
        `verdict` on the way: the caller forwards it meanwhile and calls confirm() before it
        passes anything of the answer back."""
        scopes = tenant.scopes(model)
        if fair is not None and self.keeper.has_headroom(scopes, prompt_tokens):
            cost = prompt_tokens + self.completion_estimate(parsed)
            ticket = fair.try_acquire(tenant.key, tenant.rank, tenant.spec.weight, cost)
            if ticket is not None:
                headers = {TENANT_HEADER: tenant.key}
                admitted = Admitted(tenant, model, prompt_tokens, None, ticket, fair, headers)
                admitted.guard_priority = self._better_active(fair, tenant.rank)
                admitted.verdict = asyncio.ensure_future(
                    self.keeper.admit(scopes, prompt_tokens, tenant.spec.on_store_failure)
                )
                self.metrics.tenant_queue_seconds.labels(tenant.key).observe(0.0)
                return admitted
        decision = await self.keeper.admit(scopes, prompt_tokens, tenant.spec.on_store_failure)
        headers = self._decided(tenant, decision)
        admitted = Admitted(tenant, model, prompt_tokens, decision.lease, None, fair, headers)
        if fair is None:
            return admitted
        admitted.guard_priority = self._better_active(fair, tenant.rank)
        cost = prompt_tokens + self.completion_estimate(parsed)
        queued = self.metrics.tenant_queued.labels(tenant.key)
        queued.inc()
        if held is not None:
            held.inc()
        try:
            admitted.ticket = await fair.acquire(tenant.key, tenant.rank, tenant.spec.weight, cost)
        except (QueueFull, QueueTimeout) as exc:
            reason = "queue_full" if isinstance(exc, QueueFull) else "queue_timeout"
            self.metrics.tenant_rejections.labels(tenant.key, reason).inc()
            await self.keeper.settle(admitted.lease, 0, prompt_tokens=0)  # never served
            admitted.finished = True
            raise errors.APIError(
                429,
                f"The model `{model}` is saturated: {exc}",
                type="requests",
                code=reason,
                headers={**headers, "Retry-After": str(_SHED_RETRY_S)},
            ) from None
        except BaseException:
            await self.keeper.settle(admitted.lease, 0, prompt_tokens=0)  # never served
            admitted.finished = True
            raise
        finally:
            queued.dec()
            if held is not None:
                held.dec()
        self.metrics.tenant_queue_seconds.labels(tenant.key).observe(admitted.ticket.queued_s)
        return admitted

    def _decided(self, tenant: Tenant, decision: Decision) -> dict[str, str]:
        """The response headers of a quota decision; raises the refusal (429 or 503)."""
        self.metrics.quota_store_up.set(1 if self.keeper.store_up else 0)
        headers = {**decision.headers, TENANT_HEADER: tenant.key}
        if not decision.admitted:
            reason = decision.reason or "store_unavailable"
            self.metrics.tenant_rejections.labels(tenant.key, reason).inc()
            headers["Retry-After"] = str(max(1, round(decision.retry_after_s + 0.499)))
            raise quota_refused(reason, decision.message, headers)
        return headers

    async def confirm(self, admitted: Admitted) -> None:
        """Wait for the quota's answer of a request that went ahead (nothing when it was decided
        before): admitted, it takes its lease and headers; refused, the 429/503 is raised and
        the request is over (nothing was served: the caller drops what the replica began)."""
        verdict = admitted.verdict
        if verdict is None:
            return
        # Usually answered by now (it raced the replica's first bytes). Shielded otherwise: a
        # cancelled waiter leaves it running, and finish() settles what it admits.
        decision = verdict.result() if verdict.done() else await asyncio.shield(verdict)
        admitted.verdict = None
        try:
            admitted.headers = self._decided(admitted.tenant, decision)
        except errors.APIError:
            admitted.finished = True
            if admitted.fair is not None and admitted.ticket is not None:
                admitted.fair.done(admitted.ticket, 0)
            raise
        admitted.lease = decision.lease

    def _abandoned(self, verdict: asyncio.Future[Decision]) -> None:
        """The answer to a request that ended before it came: release what it admitted."""
        if verdict.cancelled() or verdict.exception() is not None:
            return
        self.keeper.settle_soon(verdict.result().lease, 0, prompt_tokens=0)

    def _better_active(self, fair: FairQueue, rank: int) -> int | None:
        """Note the class of `rank` active on the model now; the engine priority of the best
        better class active within guard_memory_s (None: none)."""
        now = time.monotonic()
        seen = self._active.get(fair)
        if seen is None:
            seen = self._active[fair] = [-math.inf] * len(PRIORITY_CLASSES)
        seen[rank] = now
        memory_s = self.config.guard_memory_s
        for better in range(rank):
            if now - seen[better] <= memory_s:
                return ENGINE_PRIORITIES[better]
        return None

    def completion_estimate(self, parsed: ParsedRequest) -> int:
        request = parsed.request
        limit = getattr(request, "max_completion_tokens", None) or request.max_tokens
        n = getattr(request, "n", 1) or 1
        return n * min(limit or self.config.default_completion_estimate, 1 << 16)

    async def charge(self, admitted: Admitted, counted_tokens: int) -> None:
        """Completion tokens as a stream goes: charged in steps of charge_every_tokens."""
        due = counted_tokens - admitted.charged_tokens
        if admitted.lease is None or due < self.config.charge_every_tokens:
            return
        admitted.charged_tokens += due
        await self.keeper.charge(admitted.lease, due)

    def finish(
        self,
        admitted: Admitted,
        status: int,
        usage: Usage | None,
        counted: int,
        *,
        served: bool,
    ) -> None:
        """The request is over (answered, broken off, or its client gone): account for it once.
        Its tokens are what it really used: the engine's usage when it reported one, else the
        completion tokens counted as it streamed plus the prompt if it was `served` (a byte of
        the replica's answer reached the client); a request never served gets its prompt's
        charge back. The quota store's settle runs in the background: the response does not
        wait for it."""
        if admitted.finished:
            return
        admitted.finished = True
        if admitted.verdict is not None:  # it ended before its quota answered
            admitted.verdict.add_done_callback(self._abandoned)
            served = False
        completion = usage.completion_tokens if usage is not None else counted
        if usage is not None:
            prompt = usage.prompt_tokens
        else:
            prompt = admitted.prompt_tokens if served else 0
        if admitted.fair is not None and admitted.ticket is not None:
            admitted.fair.done(admitted.ticket, prompt + completion)
        tenant, model = admitted.tenant.key, admitted.model
        self.metrics.tenant_requests.labels(tenant, model, str(status)).inc()
        if usage is not None or counted:
            self.metrics.tenant_tokens.labels(tenant, model, "prompt").inc(prompt)
            self.metrics.tenant_tokens.labels(tenant, model, "completion").inc(completion)
        # Once the response is on its way (the handler's step ends first): no task, and off
        # the request's path. The keeper fails open or closed by itself; a settle the store
        # does not take expires with its lease.
        asyncio.get_running_loop().call_soon(
            self.keeper.settle_soon, admitted.lease, completion, prompt
        )
