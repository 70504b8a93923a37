"""One autoscaler tick for one InferenceService: census the pods, scrape, decide, report.

The only I/O is the injected `scrape`; the caller lists pods, reads the Deployment, then applies
TickResult.replicas to the Deployment, TickResult.status_patch to the InferenceService status, and
emits TickResult.events. Nothing here ever writes the user's spec (GitOps stays in sync).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.autoscaling.decide import Decision, decide
from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.autoscaling.observations import Observations, PodMetrics, PodSample
from kvpilot.operator.autoscaling.pods import PodCensus, count_pods
from kvpilot.operator.autoscaling.policy import AutoscalingPolicy
from kvpilot.operator.autoscaling.routers import RouterCounts
from kvpilot.operator.autoscaling.scrape import Scrape, ScrapeError, ScrapeTarget, metrics_url
from kvpilot.operator.autoscaling.state import AutoscalerState, format_time

DEFAULT_METRICS_PORT = 8000
MAX_PODS_LISTED = 10  # pod names listed in status and Event messages


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class TickResult:
    """What the caller applies. replicas None: leave the Deployment alone."""

    replicas: int | None
    status_patch: dict[str, Any] = field(default_factory=dict)
    events: tuple[EventSpec, ...] = ()
    decision: Decision | None = None


def is_tick_due(policy: AutoscalingPolicy, status: Mapping[str, Any] | None, now: float) -> bool:
    """Whether the policy's interval has passed since the last tick `status` records.

    Lets a kopf timer fire more often than the slowest per-resource intervalSeconds.
    """
    try:
        last_tick = AutoscalerState.from_dict((status or {}).get("autoscaling")).last_tick
    except ValueError:
        return True  # the tick reports the problem
    # 10 % slack: timers jitter, and skipping a tick by a hair would double the interval.
    return last_tick is None or now - last_tick >= 0.9 * policy.interval_s


async def autoscale_tick(
    body: Mapping[str, Any],
    policy: AutoscalingPolicy,
    pods: Sequence[Mapping[str, Any]],
    current_replicas: int,
    *,
    now: float,
    scrape: Scrape,
    metrics: OperatorMetrics | None = None,
    metrics_port: int = DEFAULT_METRICS_PORT,
    router: RouterCounts | None = None,
) -> TickResult:
    """Scrapes the Ready pods of `body` (an InferenceService) and decides its replicas.

    policy: its spec.autoscaling, parsed once by the caller (spec.autoscaling.policy).
    pods: the InferenceService's pods as the API returns them (any phase; terminating ones are
        ignored). current_replicas: the Deployment's spec.replicas. now: epoch seconds.
    router: its requests held and in flight at the kvpilot routers (None: no router known).
    """
    started = time.perf_counter()
    metadata = body.get("metadata") or {}
    namespace, name = str(metadata.get("namespace")), str(metadata.get("name"))
    previous = (body.get("status") or {}).get("autoscaling") or {}
    if not isinstance(previous, Mapping):  # hand-edited status: from_dict reports it below
        previous = {"window": previous}
    events: list[EventSpec] = []
    try:
        state = AutoscalerState.from_dict(previous)
    except ValueError as exc:
        state = AutoscalerState()
        events.append(EventSpec("Warning", "AutoscalerStateReset", f"{exc}; starting afresh"))

    census = count_pods(pods, now, policy.startup_grace_s)
    targets = [ScrapeTarget(pod, metrics_url(ip, metrics_port)) for pod, ip in census.ready]
    results = await scrape(targets) if targets else {}
    samples: list[PodSample] = []
    errors: dict[str, ScrapeError] = {}
    for target in targets:
        result = results.get(target.name, ScrapeError("connect", "the scraper returned nothing"))
        if isinstance(result, PodMetrics):
            samples.append(PodSample(target.name, result))
        else:
            samples.append(PodSample(target.name, None))
            errors[target.name] = result
    observations = Observations(
        current_replicas,
        tuple(samples),
        census.num_on_the_way(current_replicas),
        num_held=router.held if router is not None else 0.0,
        router_in_flight=router.in_flight if router is not None else None,
    )
    decision = decide(policy, observations, state, now)

    if errors and not state.num_missing_pods:
        listed = "; ".join(
            f"{pod}: {e.detail}" for pod, e in list(errors.items())[:MAX_PODS_LISTED]
        )
        events.append(
            EventSpec(
                "Warning",
                "MetricsUnavailable",
                f"{len(errors)} of {len(census.ready)} Ready pods did not report"
                f" metrics (skipped, no scale-down meanwhile): {listed}",
            )
        )
    elif not errors and state.num_missing_pods and observations.reporting:
        events.append(
            EventSpec("Normal", "MetricsRecovered", "all Ready pods report metrics again")
        )
    if decision.direction != "none":
        events.append(
            EventSpec(
                "Normal",
                "ScaledUp" if decision.direction == "up" else "ScaledDown",
                f"{decision.previous_replicas} -> {decision.replicas} replicas"
                f" ({decision.reason}): {decision.message}",
            )
        )
    if metrics is not None:
        _record(metrics, namespace, name, policy, decision, errors)
        metrics.autoscale_tick_duration.observe(time.perf_counter() - started)
    return TickResult(
        replicas=decision.replicas if decision.direction != "none" else None,
        status_patch=build_status_patch(decision, observations, census, errors, now),
        events=tuple(events),
        decision=decision,
    )


def build_status_patch(
    decision: Decision,
    observations: Observations,
    census: PodCensus,
    errors: Mapping[str, ScrapeError],
    now: float,
) -> dict[str, Any]:
    """The InferenceService status keys this tick owns (a merge patch: None deletes a key)."""
    reporting = observations.reporting
    running = [m.num_running for m in reporting if m.num_running is not None]
    num_ready = observations.num_ready
    current: dict[str, Any] = {
        "readyPods": num_ready,
        "reportingPods": len(reporting),
        "startingPods": census.num_starting,
        "missingPods": sorted(errors)[:MAX_PODS_LISTED],
        "numRequestsWaiting": sum(m.num_waiting for m in reporting) if reporting else None,
        "numRequestsRunning": sum(running) if running else None,
        "kvCacheUsage": (
            round(sum(m.kv_cache_usage for m in reporting) / len(reporting), 4)
            if reporting
            else None
        ),
        "load": decision.load,
        "saturation": decision.saturation,
        # None (the key removed) when no router reported this tick.
        "routerHeldRequests": (
            observations.num_held if observations.router_in_flight is not None else None
        ),
        "routerInFlightRequests": observations.router_in_flight,
    }
    return {
        "desiredReplicas": decision.replicas,
        "autoscaling": {
            **decision.state.to_dict(),
            "mode": "panic" if decision.is_panic else "stable",
            "observedAt": format_time(now),
            "metrics": current,
            "error": None,
        },
    }


def _record(
    metrics: OperatorMetrics,
    namespace: str,
    name: str,
    policy: AutoscalingPolicy,
    decision: Decision,
    errors: Mapping[str, ScrapeError],
) -> None:
    if decision.direction != "none":
        metrics.scale_decisions.labels(namespace, name, decision.direction).inc()
    for error in errors.values():
        metrics.scrape_errors.labels(namespace, name, error.kind).inc()
    metrics.desired_replicas.labels(namespace, name).set(decision.replicas)
    metrics.current_replicas.labels(namespace, name).set(decision.previous_replicas)
    metrics.max_replicas.labels(namespace, name).set(policy.max_replicas)
    metrics.panic.labels(namespace, name).set(1 if decision.is_panic else 0)
    if decision.load is not None:
        metrics.load.labels(namespace, name).set(decision.load)
    saturation = decision.saturation
    if saturation is not None:
        metrics.saturation.labels(namespace, name).set(saturation)
