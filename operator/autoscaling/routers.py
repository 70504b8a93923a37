"""What the kvpilot routers hold for each InferenceService: requests held (no routable replica
yet) and in flight, read from every Ready router pod's /metrics and summed over the routers
(they share no state, so each holds its own part of the queue).

The routers label those gauges with the InferenceService (`namespace`, `inferenceservice`), so
one scrape of every router serves the ticks of all services: RouterLoad keeps it for max_age_s
(the autoscaler's timer ticks every service on the same grid). A router that fails to answer is
left out (logged when that changes): its held requests are unseen until it answers again, which
only delays a scale-up the engines' own queues will ask for once the requests reach them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract.load_metrics import ROUTER_HELD_REQUESTS, ROUTER_IN_FLIGHT_REQUESTS
from kvpilot.operator.autoscaling.pods import is_pod_ready
from kvpilot.operator.autoscaling.scrape import (
    MetricsParseError,
    ScrapeError,
    ScrapeTarget,
    metrics_url,
)

logger = logging.getLogger(__name__)

HELD = ROUTER_HELD_REQUESTS.name
IN_FLIGHT = ROUTER_IN_FLIGHT_REQUESTS.name
ROUTER_CONTAINER = "router"
ROUTER_PORT_NAME = "http"
DEFAULT_ROUTER_PORT = 8080

ServiceKey = tuple[str, str]  # (namespace, InferenceService name)


@dataclass(frozen=True)
class RouterCounts:
    """One service's requests at the routers, summed over the routers that answered."""

    held: float = 0.0
    in_flight: float = 0.0


@dataclass(frozen=True)
class RouterSnapshot:
    counts: Mapping[ServiceKey, RouterCounts] = field(default_factory=dict)
    num_reporting: int = 0  # routers whose /metrics was read
    errors: Mapping[str, ScrapeError] = field(default_factory=dict)  # by router pod

    def for_service(self, namespace: str, name: str) -> RouterCounts | None:
        """None when no router reported (nothing known, which is not "nothing held")."""
        if not self.num_reporting:
            return None
        return self.counts.get((namespace, name), RouterCounts())


def parse_router_metrics(text: str) -> dict[ServiceKey, RouterCounts]:
    """A router's /metrics -> its held and in-flight requests per InferenceService. Series
    without the service labels (a router older than them) are left out."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from exc
    held: dict[ServiceKey, float] = {}
    in_flight: dict[ServiceKey, float] = {}
    for family in families:
        if family.name not in (HELD, IN_FLIGHT):
            continue
        into = held if family.name == HELD else in_flight
        for sample in family.samples:
            key = (sample.labels.get("namespace"), sample.labels.get("inferenceservice"))
            if sample.name != family.name or not key[0] or not key[1]:
                continue
            if not math.isfinite(sample.value) or sample.value < 0:
                raise MetricsParseError(f"{sample.name} has an invalid value {sample.value}")
            into[key] = into.get(key, 0.0) + sample.value  # type: ignore[index]
    return {
        key: RouterCounts(held.get(key, 0.0), in_flight.get(key, 0.0))
        for key in held.keys() | in_flight.keys()
    }


def router_targets(pods: Iterable[Mapping[str, Any]]) -> list[ScrapeTarget]:
    """The Ready, not terminating router pods, at their router container's http port."""
    targets = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        if metadata.get("deletionTimestamp") or not is_pod_ready(pod):
            continue
        ip = (pod.get("status") or {}).get("podIP")
        targets.append(ScrapeTarget(str(metadata.get("name")), metrics_url(ip, router_port(pod))))
    return targets


def router_port(pod: Mapping[str, Any]) -> int:
    containers = (pod.get("spec") or {}).get("containers") or []
    container = next((c for c in containers if c.get("name") == ROUTER_CONTAINER), None)
    ports = (container or {}).get("ports") or []
    port = next((p for p in ports if p.get("name") == ROUTER_PORT_NAME), ports[0] if ports else {})
    return int(port.get("containerPort") or DEFAULT_ROUTER_PORT)


def merge(results: Mapping[str, dict[ServiceKey, RouterCounts]]) -> dict[ServiceKey, RouterCounts]:
    total: dict[ServiceKey, RouterCounts] = {}
    for counts in results.values():
        for key, part in counts.items():
            seen = total.get(key, RouterCounts())
            total[key] = RouterCounts(seen.held + part.held, seen.in_flight + part.in_flight)
    return total


ListRouterPods = Callable[[], Awaitable[list[dict[str, Any]]]]
FetchText = Callable[[ScrapeTarget], Awaitable["str | ScrapeError"]]


class RouterLoad:
    """The routers' counts, scraped at most once per max_age_s whichever service asks."""

    def __init__(
        self,
        list_pods: ListRouterPods,
        fetch: FetchText,
        *,
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._list_pods = list_pods
        self._fetch = fetch
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._snapshot = RouterSnapshot()
        self._taken_at = float("-inf")
        self._failing: frozenset[str] = frozenset()

    async def snapshot(self) -> RouterSnapshot:
        async with self._lock:  # concurrent ticks share one scrape
            if self._clock() - self._taken_at >= self._max_age_s:
                self._snapshot = await self._scrape()
                self._taken_at = self._clock()
            return self._snapshot

    async def _scrape(self) -> RouterSnapshot:
        try:
            pods = await self._list_pods()
        except Exception as exc:  # API trouble: nothing known this round, the next one retries
            logger.warning("could not list the router pods: %s", exc)
            return RouterSnapshot()
        targets = router_targets(pods)
        texts = await asyncio.gather(*(self._fetch(target) for target in targets))
        results: dict[str, dict[ServiceKey, RouterCounts]] = {}
        errors: dict[str, ScrapeError] = {}
        for target, text in zip(targets, texts, strict=True):
            if isinstance(text, ScrapeError):
                errors[target.name] = text
                continue
            try:
                results[target.name] = parse_router_metrics(text)
            except MetricsParseError as exc:
                errors[target.name] = ScrapeError("parse", f"{target.url}: {exc}")
        failing = frozenset(errors)
        if failing != self._failing:
            if failing:
                listed = "; ".join(f"{pod}: {e.detail}" for pod, e in sorted(errors.items()))
                logger.warning("router pods left out of the autoscaler's load: %s", listed)
            else:
                logger.info("every router pod reports its held requests again")
            self._failing = failing
        return RouterSnapshot(merge(results), len(results), errors)
