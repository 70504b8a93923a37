"""From a parsed request to a replica's response: hold while the model has no routable replica
(asking the operator to wake it), choose a replica, forward the body, and pass the response
through as it arrives. A replica that fails before anything was sent back is marked failed and
the request goes to another; once bytes have gone to the client, a failure ends the stream.

The request path is the router's overhead on every request: the client's body is forwarded as
the bytes it sent (never re-serialized) over pooled keep-alive connections (kvpilot.router
.upstream: a small HTTP/1.1 client on httptools, cheaper per request than aiohttp's and httpx's,
bench/RESULTS.md), and a response that is not a stream goes back in one piece with its length."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpilot.contract import errors
from kvpilot.contract.http_errors import error_response
from kvpilot.contract.openai import PATHS, RequestKind
from kvpilot.contract.tenancy import unsalted_blocks
from kvpilot.router.admission import Admission, Admitted
from kvpilot.router.arrival_gate import ArrivalGate
from kvpilot.router.config import DEFAULT_REPLICA_CONCURRENCY, RouterConfig
from kvpilot.router.forwarded_body import with_fields
from kvpilot.router.hold import HoldFull, HoldTimeout
from kvpilot.router.kube import request_wake
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.prompts import ParsedRequest, block_chain, prompt_token_ids
from kvpilot.router.registry import ModelPool, Registry
from kvpilot.router.replica import Replica
from kvpilot.router.scoring import Candidate, Decision, adapter_slot, choose
from kvpilot.router.shared_prefix import shared_tokens
from kvpilot.router.tenants import Tenant, check_route_grant
from kvpilot.router.upstream import BrokenResponse, ConnectError, UpstreamPool, UpstreamResponse
from kvpilot.router.usage_meter import StreamMeter, body_usage

log = logging.getLogger("kvpilot.router")

SESSION_HEADER = "x-session-id"
_PASSED_HEADERS = ("content-type", "retry-after", "x-request-id")
_WAKE_REPEAT_S = 5.0
# Before the first byte: a connection refused, reset or closed by the replica (`connect`).
_CONNECT_ERRORS = (ConnectError, asyncio.TimeoutError, OSError)
# After it: the response broke off.
_STREAM_ERRORS = (BrokenResponse, asyncio.TimeoutError, OSError)


# Where a client finds the models an unknown one could have been.
LISTED_MODELS_HINT = "GET /v1/models lists the served models."


def unavailable(model: str, why: str, retry_after_s: int) -> errors.APIError:
    error = errors.unavailable(
        f"The model `{model}` has no ready replica: {why}.", code="no_replica"
    )
    error.headers["Retry-After"] = str(retry_after_s)
    return error


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        kube: httpx.AsyncClient | None,
        metrics: RouterMetrics,
        admission: Admission | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.kube = kube
        self.metrics = metrics
        # With tenants: every request is identified, granted, charged and queued by it.
        self.admission = admission
        # No pool limit: every in-flight request holds a connection; keep-alive saves the
        # connect on the next one. No Accept-Encoding is sent: the bytes go to the client as the
        # engine sent them, uncompressed.
        self.engines = UpstreamPool()
        # With tenants: arrivals do their work one at a time, the best class first.
        self.arrivals = ArrivalGate()

    async def stop(self) -> None:
        self.engines.close()

    def authenticate(self, headers: Mapping[str, str]) -> Tenant | None:
        """With tenants: the request's tenant (401 otherwise), before its body is read."""
        return self.admission.authenticate(headers) if self.admission is not None else None

    async def arrival_turn(self, tenant: Tenant | None) -> None:
        """Returns when the request may read, parse, tokenize and admit (arrival_gate.py);
        at once without tenants, whose requests are all of one class."""
        if tenant is not None:
            await self.arrivals.turn(tenant.rank)

    async def handle(
        self,
        kind: RequestKind,
        parsed: ParsedRequest,
        body: bytes,
        headers: Mapping[str, str],
        tenant: Tenant | None = None,
    ) -> Response:
        """tenant: authenticate()'s answer (required with tenants)."""
        model = parsed.model or ""
        if self.admission is not None:
            if tenant is None:
                tenant = self.admission.authenticate(headers)
            # The grant before the lookup: a tenant learns nothing of a model it may not use.
            self.admission.check_grant(tenant, model)
        route = self.registry.resolve(model)
        if route is None:
            raise errors.model_does_not_exist(model, LISTED_MODELS_HINT)
        if tenant is not None:
            check_route_grant(tenant, model, is_adapter=route.adapter is not None)
        pool = route.pool
        adapter = route.adapter.name if route.adapter is not None else None
        replicas = await self._routable_replicas(pool)
        # Without the tokenizer (still loading): routed by load, never held for it.
        self.registry.ensure_tokenizer(pool, replicas[0])
        token_ids = prompt_token_ids(parsed, pool.tokenizer)
        if tenant is None or self.admission is None:
            request = Forwarded(kind, model, parsed, body, headers, token_ids, adapter)
            return await self._route(pool, replicas, request)
        prompt_tokens = len(token_ids) if token_ids else estimated_tokens(body)
        service = pool.service
        held = self.metrics.held.labels(service.model, service.namespace, service.name)
        admitted = await self.admission.admit(tenant, model, parsed, prompt_tokens, pool.fair, held)
        try:
            shared = shared_tokens(token_ids, pool.shared_prefixes())
            body = with_fields(body, admitted.body_fields(parsed, shared))
            request = Forwarded(
                kind, model, parsed, body, headers, token_ids, adapter, admitted, shared
            )
            # Time passed in the queue: the replicas of now.
            replicas = pool.routable(time.monotonic(), self.config.dead_after_s) or replicas
            response = await self._route(pool, replicas, request)
        except errors.APIError as exc:
            self.admission.finish(admitted, exc.status_code, None, 0, served=False)
            exc.headers.update(admitted.headers)
            raise
        except BaseException:
            self.admission.finish(admitted, 499, None, 0, served=False)
            raise
        response.headers.update(admitted.headers)
        return response

    async def _route(
        self, pool: ModelPool, replicas: list[Replica], request: Forwarded
    ) -> Response:
        tried: set[str] = set()
        model = request.model
        for _ in range(self.config.max_attempts):
            candidates = [r for r in replicas if r.name not in tried]
            if request.admitted is not None:
                # The fair queue let it go because one of these has room for its class.
                rank = request.admitted.tenant.rank
                concurrency = (
                    self.config.tenancy.replica_concurrency if self.config.tenancy else None
                )
                roomy = [
                    r
                    for r in candidates
                    if r.has_room(rank, concurrency, DEFAULT_REPLICA_CONCURRENCY)
                ]
                candidates = roomy or candidates
            if not candidates:
                break
            replica, decision = self._choose(pool, candidates, request)
            tried.add(replica.name)
            response = await self._forward(pool, replica, request)
            if response is not None:
                tokens = decision.matched_blocks * (replica.block_size or 0)
                route_header = f"{decision.reason}; prefix-tokens={tokens}"
                if decision.slot is not None:
                    route_header += f"; adapter={decision.slot}"
                response.headers["x-kvpilot-replica"] = replica.name
                response.headers["x-kvpilot-route"] = route_header
                self.metrics.decided(model, decision.reason, tokens, decision.slot)
                return response
            replicas = pool.routable(time.monotonic(), self.config.dead_after_s)
        raise unavailable(model, "every replica tried failed", self.config.hold.retry_after_s)

    # ---- holding ----
    async def _routable_replicas(self, pool: ModelPool) -> list[Replica]:
        model = pool.service.model
        timeout_s = pool.service.hold_timeout_s or self.config.hold.timeout_s
        deadline = time.monotonic() + timeout_s
        held_since: float | None = None
        while True:
            now = time.monotonic()
            replicas = pool.routable(now, self.config.dead_after_s)
            if replicas:
                if held_since is not None:
                    self.metrics.hold_seconds.labels(model).observe(now - held_since)
                return replicas
            if held_since is None:
                held_since = now
                log.debug("holding a request for %s (no routable replica)", model)
            self._ask_to_wake(pool)
            try:
                held = self.metrics.held.labels(model, pool.service.namespace, pool.service.name)
                held.inc()
                try:
                    await pool.hold.wait(timeout_s=max(0.0, deadline - now))
                finally:
                    held.dec()
            except HoldFull:
                self.metrics.hold_rejections.labels(model, "full").inc()
                raise unavailable(
                    model, "too many requests are waiting for it", self.config.hold.retry_after_s
                ) from None
            except HoldTimeout:
                self.metrics.hold_rejections.labels(model, "timeout").inc()
                raise unavailable(
                    model,
                    f"none became ready within {timeout_s:g} s",
                    self.config.hold.retry_after_s,
                ) from None
            if self.registry.pools.get(model) is not pool:
                raise unavailable(model, "it was removed", self.config.hold.retry_after_s)

    def _ask_to_wake(self, pool: ModelPool) -> None:
        """Annotate the InferenceService (at most every few seconds per router and model)."""
        service = pool.service
        now = time.monotonic()
        if self.kube is None or not service.may_scale_to_zero:
            return
        if now - pool.last_wake_request < _WAKE_REPEAT_S:
            return
        pool.last_wake_request = now
        self.metrics.wake_requests.labels(service.model).inc()
        log.info("asking for %s/%s to be woken", service.namespace, service.name)

        async def wake() -> None:
            try:
                await request_wake(
                    self.kube, service.namespace, service.name, self.config.router_name
                )
            except Exception as exc:
                log.warning("could not ask for %s to be woken: %s", service.name, exc)
                pool.last_wake_request = float("-inf")

        asyncio.get_running_loop().create_task(wake())

    # ---- choosing ----
    def _choose(
        self, pool: ModelPool, replicas: list[Replica], request: Forwarded
    ) -> tuple[Replica, Decision]:
        token_ids, adapter = request.token_ids, request.adapter
        block_size = next((r.block_size for r in replicas if r.block_size), None)
        salt = request.cache_salt
        unsalted = unsalted_blocks(request.shared_tokens, block_size) if block_size else 0
        chain = block_chain(token_ids, block_size, salt, adapter, unsalted_blocks=unsalted)
        candidates = [
            Candidate(
                r.name,
                r.index.matched_blocks(chain) if r.block_size == block_size else 0,
                r.in_flight,
                r.load.num_waiting,
                r.load.kv_cache_usage,
                None
                if adapter is None
                else adapter_slot(adapter, r.load.resident_loras, r.load.max_loras),
            )
            for r in replicas
        ]
        if adapter is not None:
            # Routers that share nothing place an adapter resident nowhere yet on the same
            # replica, so it is loaded once, not once per router.
            tie_key = adapter
        else:
            tie_key = str(chain[0]) if chain else str(token_ids[:64] if token_ids else "")
        decision = choose(
            candidates,
            num_blocks=len(chain) if token_ids else 0,
            tie_key=tie_key,
            session_id=request.headers.get(SESSION_HEADER),
            config=self.config.routing,
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %s -> %s (%s): %d/%d blocks matched, adapter %s; candidates %s",
                adapter or pool.service.model,
                decision.name,
                decision.reason,
                decision.matched_blocks,
                len(chain),
                decision.slot,
                [
                    (c.name, c.matched_blocks, c.in_flight, c.num_waiting, c.slot)
                    for c in candidates
                ],
            )
        chosen = next(r for r in replicas if r.name == decision.name)
        return chosen, decision

    # ---- forwarding ----
    async def _forward(
        self, pool: ModelPool, replica: Replica, request: Forwarded
    ) -> Response | None:
        """The replica's response (passed on as it streams, or whole when it is not a stream);
        None when it failed before answering."""
        model = pool.service.model
        headers, admitted = request.headers, request.admitted
        outgoing = {"content-type": headers.get("content-type", "application/json")}
        if replica.engine_key:  # the key its engine accepted for its event stream
            outgoing["authorization"] = f"Bearer {replica.engine_key}"
        elif admitted is None and headers.get("authorization"):
            # Without tenants the client's key is the engines' own; a tenant's key never leaves.
            outgoing["authorization"] = headers["authorization"]
        self._taken(replica, admitted)
        try:
            upstream = await self.engines.post(
                replica.url, PATHS[request.kind], outgoing, request.body
            )
        except _CONNECT_ERRORS as exc:
            self._released(pool, replica, admitted)
            replica.failed_at = time.monotonic()
            self.metrics.upstream_errors.labels(model, "connect").inc()
            log.warning("replica %s failed (%r): trying another", replica.name, exc)
            return None
        except BaseException:  # the client went away before the replica answered, or a bug
            self._released(pool, replica, admitted)
            raise
        if upstream.status == 401 and replica.engine_key:  # the router's key, not a client's
            self.registry.keys.refused(pool.service, "proxy")  # passed on; the key read again
        if upstream.status in (502, 503, 504):  # draining or overloaded: nothing was sent
            self._released(pool, replica, admitted)
            upstream.release()
            self.metrics.upstream_errors.labels(model, f"status_{upstream.status}").inc()
            return None
        if admitted is not None and admitted.verdict is not None and self.admission is not None:
            # It went ahead of its quota's answer: nothing goes back before it (refused: 429,
            # and what the replica began is dropped).
            try:
                await self.admission.confirm(admitted)
            except BaseException:
                self._released(pool, replica, admitted)
                upstream.close()
                raise
        passed = {k: v for k, v in upstream.raw_headers if k in _PASSED_HEADERS}
        if request.parsed.request.stream:
            meter = None
            if admitted is not None:
                meter = StreamMeter(client_wants_usage=request.parsed.request.include_usage)
            relay = _Relay(self, pool, replica, upstream, admitted, meter)
            return RelayResponse(relay, upstream.status, passed)
        # One piece with a Content-Length: one write to the client instead of a chunked stream.
        try:
            content = await upstream.read()
        except _STREAM_ERRORS as exc:
            upstream.close()
            self.metrics.upstream_errors.labels(model, "stream").inc()
            log.warning("replica %s broke its response off: %r", replica.name, exc)
            if admitted is not None and self.admission is not None:
                self.admission.finish(admitted, 502, None, 0, served=False)
            return error_response(
                errors.APIError(
                    502, f"The replica {replica.name} broke its response off.", type="api_error"
                )
            )
        except BaseException:  # cancelled: the connection is mid-response, never reused
            upstream.close()
            raise
        finally:
            self._released(pool, replica, admitted)
        upstream.release()
        if admitted is not None and self.admission is not None:
            status = upstream.status
            self.admission.finish(admitted, status, body_usage(content), 0, served=status < 400)
        return Response(content, upstream.status, headers=passed)

    def _taken(self, replica: Replica, admitted: Admitted | None) -> None:
        replica.in_flight += 1
        if admitted is not None:
            replica.in_flight_by_rank[admitted.tenant.rank] += 1

    def _released(self, pool: ModelPool, replica: Replica, admitted: Admitted | None) -> None:
        replica.in_flight -= 1
        if admitted is not None:
            replica.in_flight_by_rank[admitted.tenant.rank] -= 1
            if pool.fair is not None:
                pool.fair.kick()  # its room goes to the next in the fair queue


class _Relay:
    """One streamed response on its way from a replica to the client. It holds the replica's
    slot (in_flight), the upstream connection and, with tenants, the request's accounting; close()
    gives all of them back exactly once: when the stream ends or breaks, when the client goes
    away mid-stream, or when the response is dropped before its first byte (the client gone
    before Starlette iterated it: an async generator never started runs no `finally`)."""

    def __init__(
        self,
        proxy: Proxy,
        pool: ModelPool,
        replica: Replica,
        upstream: UpstreamResponse,
        admitted: Admitted | None,
        meter: StreamMeter | None,
    ) -> None:
        self.proxy = proxy
        self.pool = pool
        self.replica = replica
        self.upstream = upstream
        self.admitted = admitted
        self.meter = meter
        self.status = upstream.status
        self.started = False  # iterated at all
        self.served = False  # a byte of the answer reached the client
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        admission, admitted, meter = self.proxy.admission, self.admitted, self.meter
        self.started = True
        try:
            async for chunk in self.upstream.chunks():
                if meter is None:
                    yield chunk
                    self.served = True
                    continue
                passed = meter.feed(chunk)
                if passed:
                    yield passed
                    self.served = True
                if admitted is not None and admission is not None:
                    await admission.charge(admitted, meter.counted_tokens)
            if meter is not None:
                rest = meter.flush()
                if rest:
                    yield rest
        except _STREAM_ERRORS as exc:
            self.status = 502
            self.proxy.metrics.upstream_errors.labels(self.pool.service.model, "stream").inc()
            log.warning("replica %s broke a response mid-stream: %r", self.replica.name, exc)
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.proxy._released(self.pool, self.replica, self.admitted)
        # A stream cut short (the client went away) cannot go back to the pool.
        if self.upstream.is_eof:
            self.upstream.release()
        else:
            self.upstream.close()
        admission, admitted, meter = self.proxy.admission, self.admitted, self.meter
        if admitted is not None and meter is not None and admission is not None:
            status = self.status if self.started else 499  # never started: the client left
            admission.finish(
                admitted, status, meter.usage, meter.counted_tokens, served=self.served
            )


class RelayResponse(StreamingResponse):
    """A replica's stream passed on; whatever becomes of the response (streamed to its end, cut
    off, or never started because the client left first), its relay is closed once it is done
    with."""

    def __init__(self, relay: _Relay, status_code: int, headers: Mapping[str, str]) -> None:
        super().__init__(relay.chunks(), status_code, headers=headers)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.discard()

    def discard(self) -> None:
        """Give the relay's holds back (nothing if the stream already did)."""
        self.relay.close()


@dataclass(frozen=True)
class Forwarded:
    """One request on its way to a replica: the body to send (with a tenant's fields set) and
    what choosing its replica needs."""

    kind: RequestKind
    model: str  # the `model` id the client named
    parsed: ParsedRequest
    body: bytes
    headers: Mapping[str, str]
    token_ids: list[int] | None
    adapter: str | None  # the LoRA adapter it names (None: the base model)
    admitted: Admitted | None = None  # its tenant's admission, with tenants
    shared_tokens: int = 0  # prompt tokens inside a prefix shared across tenants

    @property
    def cache_salt(self) -> str | None:
        """The salt the engine hashes its blocks with: the tenant's, with tenants."""
        client_salt = self.parsed.request.cache_salt
        return client_salt if self.admitted is None else self.admitted.salt(client_salt)


def estimated_tokens(body: bytes) -> int:
    """A prompt's tokens while the tokenizer is not loaded: about 4 bytes each (the engine's
    usage settles it)."""
    return max(1, len(body) // 4)
