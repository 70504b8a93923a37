"""The router's view of the cluster: InferenceServices (by served model name) and their Ready
engine pods, each followed through its block-event stream, and which service every `model` id
(a served model name or a LoRA adapter's name) goes to. Fed by the Kubernetes watches; every
change re-derives the pools and the routes from the latest objects (level-based, so a missed event
heals at the next one).
Which service keeps a `model` id that several claim: kvpilot.router.model_ids."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from kvpilot.router.cluster import Adapter, Endpoint, ServiceInfo, endpoint, service_info
from kvpilot.router.config import DEFAULT_REPLICA_CONCURRENCY, RouterConfig
from kvpilot.router.engine_keys import EngineKeys, bearer
from kvpilot.router.fair_queue import FairQueue
from kvpilot.router.hold import HoldQueue
from kvpilot.router.index import BlockIndex
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.model_ids import ServiceKey, claim_model_ids
from kvpilot.router.replica import Replica, follow
from kvpilot.router.shared_prefix import shared_prefix_token_ids
from kvpilot.router.tokenizer import fetch_tokenizer

log = logging.getLogger("kvpilot.router")

_TOKENIZER_RETRY_S = 5.0


@dataclass
class ModelPool:
    """One InferenceService as the router serves it."""

    service: ServiceInfo
    hold: HoldQueue
    replicas: dict[str, Replica] = field(default_factory=dict)
    followers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Loaded in the background: requests never wait for it (until it is there they are routed
    # by load). Kept while the service keeps its model_uri, at zero replicas too, so a woken
    # model routes by prefix at once.
    tokenizer: Any = None
    tokenizer_uri: str = ""  # the service's model_uri the tokenizer was loaded for
    tokenizer_task: asyncio.Task[None] | None = None
    tokenizer_failed_at: float = float("-inf")
    last_wake_request: float = float("-inf")
    # With tenants: where requests wait while every replica is saturated for their class.
    fair: FairQueue | None = None
    # The token ids of service.shared_prefixes, for the tokenizer they were computed with.
    shared_prefix_ids: tuple[tuple[int, ...], ...] = ()
    shared_prefix_key: tuple[int, tuple[str, ...]] | None = None

    def shared_prefixes(self) -> tuple[tuple[int, ...], ...]:
        """The service's shared prefixes as token ids (none until the tokenizer is loaded)."""
        if self.tokenizer is None or not self.service.shared_prefixes:
            return ()
        key = (id(self.tokenizer), self.service.shared_prefixes)
        if key != self.shared_prefix_key:
            self.shared_prefix_ids = shared_prefix_token_ids(
                self.service.shared_prefixes, self.tokenizer
            )
            self.shared_prefix_key = key
        return self.shared_prefix_ids

    def routable(self, now: float, dead_after_s: float) -> list[Replica]:
        return [r for r in self.replicas.values() if r.is_routable(now, dead_after_s)]


@dataclass(frozen=True)
class Route:
    """Where requests for one `model` id go: a pool, and the adapter they name (None: its base
    model)."""

    pool: ModelPool
    adapter: Adapter | None = None


class Registry:
    def __init__(
        self,
        config: RouterConfig,
        engines: httpx.AsyncClient,
        metrics: RouterMetrics,
        keys: EngineKeys | None = None,
    ) -> None:
        self.config = config
        self.engines = engines
        self.metrics = metrics
        # The key each service's replicas require (on every path the router calls).
        self.keys = keys or EngineKeys(
            None, metrics, fallback=config.engine_api_key, refresh_s=config.engine_key_refresh_s
        )
        # The replicas' block-event streams (made by RouterRuntime.start, in the serving loop).
        self.streams: aiohttp.ClientSession | None = None
        self.services: dict[tuple[str, str], ServiceInfo] = {}
        self.endpoints: dict[tuple[str, str], Endpoint] = {}
        self.pools: dict[str, ModelPool] = {}  # by served model name
        self.routes: dict[str, Route] = {}  # by `model` id: served names and adapters
        self._conflicts: frozenset[tuple[str, ServiceKey, ServiceKey]] = frozenset()

    def resolve(self, model: str) -> Route | None:
        """The pool (and adapter) a request's `model` goes to; None for an unknown id."""
        return self.routes.get(model)

    # ---- watch callbacks ----
    def services_listed(self, namespace: str, items: list[dict[str, Any]]) -> None:
        """A full listing of one namespace ("": of all) replaces what was known of it."""
        self.services = {k: v for k, v in self.services.items() if namespace and k[0] != namespace}
        for obj in items:
            info = service_info(obj)
            self.services[(info.namespace, info.name)] = info
        self.sync()

    def service_event(self, kind: str, obj: dict[str, Any]) -> None:
        info = service_info(obj)
        key = (info.namespace, info.name)
        if kind == "DELETED":
            self.services.pop(key, None)
        else:
            self.services[key] = info
        self.sync()

    def pods_listed(self, namespace: str, items: list[dict[str, Any]]) -> None:
        self.endpoints = {
            k: v for k, v in self.endpoints.items() if namespace and k[0] != namespace
        }
        for pod in items:
            found = endpoint(pod)
            if found is not None:
                self.endpoints[(found.namespace, found.pod)] = found
        self.sync()

    def pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        found = endpoint(pod)
        if kind == "DELETED" or found is None:
            self.endpoints.pop(key, None)
        else:
            self.endpoints[key] = found
        self.sync()

    # ---- derived state ----
    def sync(self) -> None:
        self.keys.want(s.api_key_secret for s in self.services.values() if s.api_key_secret)
        claims = claim_model_ids(self.services.values())
        for model_id, winner, loser in sorted(claims.conflicts - self._conflicts):
            log.warning(
                "model %r is claimed by both %s/%s and %s/%s: routing it to %s/%s",
                model_id, *winner, *loser, *winner,
            )  # fmt: skip
        self._conflicts = claims.conflicts
        by_model = claims.models
        for model in list(self.pools):
            if model not in by_model:
                self._drop_pool(self.pools.pop(model))
        for model, info in by_model.items():
            pool = self.pools.get(model)
            if pool is None or (pool.service.namespace, pool.service.name) != (
                info.namespace,
                info.name,
            ):
                if pool is not None:
                    self._drop_pool(pool)
                pool = self.pools[model] = ModelPool(info, HoldQueue(self.config.hold))
                pool.fair = self._fair_queue(pool)
            pool.service = info
            if info.model_uri != pool.tokenizer_uri:  # other weights: maybe another tokenizer
                self._forget_tokenizer(pool)
            wanted = {
                e.pod: e
                for e in self.endpoints.values()
                if e.is_ready and (e.namespace, e.service) == (info.namespace, info.name)
            }
            for name in list(pool.replicas):
                gone = name not in wanted or wanted[name].url != pool.replicas[name].url
                if gone:
                    self._drop_replica(pool, name)
            for name, found in wanted.items():
                if name not in pool.replicas:
                    self._add_replica(pool, found)
        routes = {model: Route(pool) for model, pool in self.pools.items()}
        for name, (info, adapter) in claims.adapters.items():
            routes[name] = Route(self.pools[info.model], adapter)
        self.routes = routes

    def _fair_queue(self, pool: ModelPool) -> FairQueue | None:
        tenancy = self.config.tenancy
        if tenancy is None:
            return None
        dead_after_s = self.config.dead_after_s

        def has_capacity(rank: int) -> bool:
            now = time.monotonic()
            return any(
                r.has_room(rank, tenancy.replica_concurrency, DEFAULT_REPLICA_CONCURRENCY)
                for r in pool.routable(now, dead_after_s)
            )

        return FairQueue(
            has_capacity,
            max_queued=tenancy.max_queued_per_model,
            timeout_s=tenancy.queue_timeout_s,
        )

    def _add_replica(self, pool: ModelPool, found: Endpoint) -> None:
        assert self.streams is not None, "RouterRuntime.start() gives the streams their session"
        replica = Replica(found.pod, found.url, BlockIndex(self.config.max_blocks_per_replica))
        pool.replicas[found.pod] = replica
        pool.followers[found.pod] = asyncio.get_running_loop().create_task(
            follow(
                replica,
                self.streams,
                dead_after_s=self.config.dead_after_s,
                on_synced=lambda: self._replica_synced(pool, replica),
                candidate_keys=lambda: self.keys.candidates(pool.service),
                on_unauthorized=lambda: self.keys.refused(pool.service, "kv-events"),
            ),
            name=f"follow-{found.pod}",
        )
        log.debug("replica %s of %s at %s", found.pod, pool.service.model, found.url)

    def _drop_replica(self, pool: ModelPool, name: str) -> None:
        pool.replicas.pop(name, None)
        task = pool.followers.pop(name, None)
        if task is not None:
            task.cancel()
        log.debug("replica %s of %s removed", name, pool.service.model)

    def _drop_pool(self, pool: ModelPool) -> None:
        for name in list(pool.replicas):
            self._drop_replica(pool, name)
        if pool.tokenizer_task is not None:
            pool.tokenizer_task.cancel()
        pool.hold.release()  # they look the model up again and find it gone
        if pool.fair is not None:
            pool.fair.close()

    def _replica_synced(self, pool: ModelPool, replica: Replica) -> None:
        log.info("replica %s of %s is routable", replica.name, pool.service.model)
        # Held requests go at once, routed by load until the tokenizer is there: fetching and
        # loading it took seconds of a wake (bench/RESULTS.md), and with one replica the choice
        # is the same anyway.
        pool.hold.release()
        if pool.fair is not None:
            pool.fair.kick()  # room for queued requests
        self.ensure_tokenizer(pool, replica)

    def ensure_tokenizer(self, pool: ModelPool, replica: Replica) -> None:
        """Start loading the pool's tokenizer from `replica` unless it is loaded or loading (or
        failed in the last few seconds)."""
        if pool.tokenizer is not None or pool.tokenizer_task is not None:
            return
        if time.monotonic() - pool.tokenizer_failed_at < _TOKENIZER_RETRY_S:
            return
        pool.tokenizer_task = asyncio.get_running_loop().create_task(
            self._load_tokenizer(pool, replica), name=f"tokenizer-{pool.service.model}"
        )

    async def _load_tokenizer(self, pool: ModelPool, replica: Replica) -> None:
        uri = pool.service.model_uri
        try:
            tokenizer = await fetch_tokenizer(self.engines, replica.url, bearer(replica.engine_key))
        except Exception as exc:
            if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
                self.keys.refused(pool.service, "tokenizer")
            pool.tokenizer_failed_at = time.monotonic()
            log.warning("could not fetch %s's tokenizer", pool.service.model, exc_info=True)
        else:
            if pool.service.model_uri == uri:  # not for weights replaced meanwhile
                pool.tokenizer, pool.tokenizer_uri = tokenizer, uri
                if tokenizer is None:
                    # Asked again only after the retry interval: every request would otherwise
                    # send the replica its tokenizer requests again.
                    first = pool.tokenizer_failed_at == float("-inf")
                    pool.tokenizer_failed_at = time.monotonic()
                    log.log(
                        logging.INFO if first else logging.DEBUG,
                        "%s's replica serves no tokenizer: routed by load",
                        pool.service.model,
                    )
                else:
                    log.info("tokenizer of %s loaded", pool.service.model)
        finally:
            if pool.tokenizer_task is asyncio.current_task():
                pool.tokenizer_task = None

    def _forget_tokenizer(self, pool: ModelPool) -> None:
        if pool.tokenizer_task is not None:
            pool.tokenizer_task.cancel()
            pool.tokenizer_task = None
        pool.tokenizer = None
        pool.tokenizer_uri = pool.service.model_uri
        pool.tokenizer_failed_at = float("-inf")

    def refresh_gauges(self) -> None:
        now = time.monotonic()
        for model, pool in self.pools.items():
            routable = len(pool.routable(now, self.config.dead_after_s))
            self.metrics.replicas.labels(model, "routable").set(routable)
            self.metrics.replicas.labels(model, "unroutable").set(len(pool.replicas) - routable)
            self.metrics.in_flight.labels(model, pool.service.namespace, pool.service.name).set(
                sum(r.in_flight for r in pool.replicas.values())
            )

    def close(self) -> None:
        for pool in self.pools.values():
            self._drop_pool(pool)
        self.pools.clear()
        self.routes.clear()
