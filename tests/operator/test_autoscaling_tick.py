"""The autoscaler tick end to end: real HTTP scrapes of live registries, status and Events applied.

A small stand-in for the API server keeps the InferenceService (status merged with JSON merge
patches, as kopf's status patch is applied), the Deployment's replicas, the pods and the Events.
The clock is injected: ticks run back to back while `now` advances 5 s each.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.operator.autoscaling import (
    AutoscalingPolicy,
    EventSpec,
    MetricsScraper,
    OperatorMetrics,
    TickResult,
    autoscale_tick,
    is_tick_due,
)
from kvpilot.operator.spec import parse_spec

from .autoscaling_helpers import FakeEnginePod, merge_patch, pod_dict, serve_pods

T0 = 1_700_000_000.0
INTERVAL = 5.0
SPEC = {
    "model": {"uri": "builtin://smollm2-135m-instruct"},
    "autoscaling": {
        "minReplicas": 1,
        "maxReplicas": 6,
        "targetQueueDepth": 5,
        "targetKVCacheUtilization": 0.8,
    },
}


# Generous for loopback: a shared 2-core CI machine once took over 0.3 s to answer a scrape here,
# which the autoscaler rightly reports as MetricsUnavailable. Only the "slow" pod waits this long.
SCRAPE_TIMEOUT_S = 2.0


@dataclass
class Cluster:
    """What the API server would hold for one InferenceService, and the engines behind its pods."""

    engines: list[FakeEnginePod]
    port: int
    scraper: MetricsScraper
    metrics: OperatorMetrics
    spec: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SPEC))
    replicas: int = 2
    num_ready: int = 2
    now: float = T0
    status: dict[str, Any] = field(default_factory=dict)
    events: list[EventSpec] = field(default_factory=list)
    results: list[TickResult] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        # Through JSON, as a real read returns it: nothing but the status carries state over.
        return json.loads(
            json.dumps(
                {
                    "apiVersion": "kvpilot.dev/v1alpha1",
                    "kind": "InferenceService",
                    "metadata": {"name": "chat", "namespace": "serving", "generation": 1},
                    "spec": self.spec,
                    "status": self.status,
                }
            )
        )

    def pods(self) -> list[dict[str, Any]]:
        """Pod i is served by engine i; pods beyond num_ready are still loading."""
        return [
            pod_dict(
                f"chat-{i}",
                self.engines[i].host,
                is_ready=i < self.num_ready,
                created=T0 - 60 if i < self.num_ready else self.now - 1,
            )
            for i in range(self.replicas)
        ]

    async def tick(self) -> TickResult:
        body = self.body()
        spec_before = copy.deepcopy(body["spec"])
        autoscaling = parse_spec(body["spec"]).autoscaling
        assert autoscaling is not None
        result = await autoscale_tick(
            body,
            autoscaling.policy,
            self.pods(),
            self.replicas,
            now=self.now,
            scrape=self.scraper,
            metrics=self.metrics,
            metrics_port=self.port,
        )
        assert body["spec"] == spec_before, "the tick must never touch the user's spec"
        assert "spec" not in result.status_patch
        if result.replicas is not None:  # what the lead's handler patches into the Deployment
            self.replicas = result.replicas
            self.num_ready = min(self.num_ready, self.replicas)
        merge_patch(self.status, result.status_patch)
        self.events += result.events
        self.results.append(result)
        self.now += INTERVAL
        return result

    def set_load(self, *, waiting: float, kv: float) -> None:
        for engine in self.engines:
            engine.set(waiting=waiting, kv=kv, running=kv * 16)


@pytest.fixture()
async def cluster() -> AsyncIterator[Cluster]:
    async with serve_pods(6) as (engines, port):
        scraper = MetricsScraper(timeout_s=SCRAPE_TIMEOUT_S)
        metrics = OperatorMetrics(CollectorRegistry())
        yield Cluster(engines, port, scraper, metrics)
        await scraper.aclose()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(
        name, {"namespace": "serving", "inferenceservice": "chat", **labels}
    )


async def test_queue_rise_scales_up_then_drain_scales_down_after_the_window(
    cluster: Cluster,
) -> None:
    cluster.set_load(waiting=0, kv=0.8)  # at target
    for _ in range(4):
        assert (await cluster.tick()).replicas is None
    assert cluster.status["desiredReplicas"] == 2
    assert cluster.status["autoscaling"]["metrics"]["kvCacheUsage"] == 0.8

    # The queue rises to 20 per pod: saturation 4, panic, scale up at once (2 -> 5).
    cluster.set_load(waiting=20, kv=1.0)
    result = await cluster.tick()
    assert result.replicas == cluster.replicas == 5
    assert cluster.status["desiredReplicas"] == 5
    assert cluster.status["autoscaling"]["mode"] == "panic"
    assert cluster.status["autoscaling"]["metrics"]["numRequestsWaiting"] == 40
    assert cluster.status["autoscaling"]["decisions"][-1]["reason"] == "PanicScaleUp"
    assert cluster.status["autoscaling"]["lastScaleTime"] == "2023-11-14T22:13:40.000Z"
    assert [(e.type, e.reason) for e in cluster.events] == [("Normal", "ScaledUp")]
    assert cluster.events[0].message.startswith("2 -> 5 replicas (PanicScaleUp)")

    # Three pods load their model: capacity on its way, no second scale-up meanwhile.
    for _ in range(3):
        assert (await cluster.tick()).replicas is None
    assert cluster.status["autoscaling"]["decisions"][-1]["reason"] == "WaitingForStartingPods"
    assert cluster.status["autoscaling"]["metrics"]["startingPods"] == 3
    untouched = [engine.num_scrapes for engine in cluster.engines[2:5]]
    assert untouched == [0, 0, 0], "pods are not judged before they are Ready"

    # Ready, and the queue drains to nothing: no scale-up on the stale samples, and the
    # replicas stay until the scale-down window (300 s) has passed over every high tick.
    cluster.num_ready = 5
    cluster.set_load(waiting=0, kv=0.0)
    drained_at = cluster.now
    while (result := await cluster.tick()).replicas is None:
        assert cluster.now - drained_at < 400, "never scaled down"
    assert 300 <= cluster.now - INTERVAL - drained_at <= 300 + 20  # + panic's 20 s tail
    assert result.replicas == cluster.replicas == 3  # at most halved per step
    assert cluster.events[-1].reason == "ScaledDown"
    ticks_to_min = 0
    while cluster.replicas > 1:
        await cluster.tick()
        ticks_to_min += 1
    assert ticks_to_min == 2  # 3 -> 2 -> 1, one step per tick
    assert [e.reason for e in cluster.events] == [
        "ScaledUp",
        "ScaledDown",
        "ScaledDown",
        "ScaledDown",
    ]
    decisions = cluster.status["autoscaling"]["decisions"]
    assert len(decisions) == 5
    assert [(d["fromReplicas"], d["toReplicas"]) for d in decisions[-3:]] == [
        (5, 3),
        (3, 2),
        (2, 1),
    ]

    registry = cluster.metrics.registry
    assert sample(registry, "kvpilot_operator_scale_decisions_total", direction="up") == 1
    assert sample(registry, "kvpilot_operator_scale_decisions_total", direction="down") == 3
    assert sample(registry, "kvpilot_operator_desired_replicas") == 1
    num_ticks = len(cluster.results)
    assert registry.get_sample_value("kvpilot_operator_autoscale_tick_duration_seconds_count") == (
        num_ticks
    )
    text = generate_latest(registry).decode()
    assert 'kvpilot_operator_scale_decisions_total{direction="down"' in text


async def test_a_failing_endpoint_blocks_scale_down_and_warns_once(cluster: Cluster) -> None:
    cluster.replicas = cluster.num_ready = 3
    cluster.set_load(waiting=0, kv=0.0)  # idle: without the failure it would scale down
    cluster.engines[2].mode = "error"
    for _ in range(80):  # 400 s, well past the scale-down window
        assert (await cluster.tick()).replicas is None
    assert cluster.status["desiredReplicas"] == 3
    assert cluster.status["autoscaling"]["metrics"]["missingPods"] == ["chat-2"]
    assert cluster.status["autoscaling"]["metrics"]["reportingPods"] == 2
    assert cluster.status["autoscaling"]["decisions"][-1]["reason"] == "MissingMetrics"
    warnings = [e for e in cluster.events if e.type == "Warning"]
    assert [e.reason for e in warnings] == ["MetricsUnavailable"]
    assert "chat-2" in warnings[0].message and "HTTP 500" in warnings[0].message
    errors = sample(
        cluster.metrics.registry, "kvpilot_operator_scrape_errors_total", kind="http_status"
    )
    assert errors == 80

    # A timeout is missing data too, not an idle pod.
    cluster.engines[2].mode = "slow"
    assert (await cluster.tick()).replicas is None
    assert (
        sample(cluster.metrics.registry, "kvpilot_operator_scrape_errors_total", kind="timeout")
        == 1
    )

    # Once every pod reports again, the long-covered window lets it scale down.
    cluster.engines[2].mode = "ok"
    result = await cluster.tick()
    assert result.replicas == 2
    assert [e.reason for e in cluster.events] == [
        "MetricsUnavailable",
        "MetricsRecovered",
        "ScaledDown",
    ]


async def test_garbage_from_every_pod_holds_the_replicas(cluster: Cluster) -> None:
    for engine in cluster.engines:
        engine.mode = "garbage"
    for _ in range(70):
        assert (await cluster.tick()).replicas is None
    assert cluster.status["autoscaling"]["decisions"][-1]["reason"] == "NoMetrics"
    assert "load" not in cluster.status["autoscaling"]["metrics"]  # null deletes it
    assert cluster.status["autoscaling"]["window"]["samples"] == []


async def test_windows_survive_an_operator_restart(cluster: Cluster) -> None:
    """A new scraper and new metrics mid-window: the scale-down still waits for the same tick."""
    cluster.replicas = cluster.num_ready = 4
    cluster.set_load(waiting=0, kv=0.8)
    for _ in range(10):
        await cluster.tick()
    cluster.set_load(waiting=0, kv=0.0)
    first_idle = cluster.now
    for _ in range(30):
        assert (await cluster.tick()).replicas is None

    await cluster.scraper.aclose()  # the operator restarts: only the status remains
    cluster.scraper = MetricsScraper(timeout_s=SCRAPE_TIMEOUT_S)
    cluster.metrics = OperatorMetrics(CollectorRegistry())
    while (await cluster.tick()).replicas is None:
        pass
    scaled_at = cluster.now - INTERVAL
    # The last recommendation of 4 came one tick before the first idle one.
    assert scaled_at == first_idle - INTERVAL + 300 + INTERVAL
    assert cluster.replicas == 3


async def test_corrupt_state_in_status_starts_afresh(cluster: Cluster) -> None:
    cluster.status = {"autoscaling": {"window": {"samples": [["yesterday", 1]]}}}
    await cluster.tick()
    assert [e.reason for e in cluster.events] == ["AutoscalerStateReset"]
    assert len(cluster.status["autoscaling"]["window"]["samples"]) == 1


def test_is_tick_due() -> None:
    policy = AutoscalingPolicy(max_replicas=4)  # intervalSeconds 5
    assert is_tick_due(policy, {}, T0)
    assert is_tick_due(policy, None, T0)
    status = {"autoscaling": {"window": {"lastTick": T0}}}
    assert not is_tick_due(policy, status, T0 + 4.0)
    assert is_tick_due(policy, status, T0 + 4.6)  # 10 % slack for timer jitter
    assert not is_tick_due(AutoscalingPolicy(max_replicas=4, interval_s=30), status, T0 + 20)
    corrupt = {"autoscaling": {"window": {"lastTick": "yesterday"}}}
    assert is_tick_due(policy, corrupt, T0)  # the tick reports it and starts afresh


def test_forget_drops_the_series_of_a_deleted_service() -> None:
    metrics = OperatorMetrics(CollectorRegistry())
    metrics.desired_replicas.labels("serving", "chat").set(3)
    metrics.scale_decisions.labels("serving", "chat", "up").inc()
    metrics.scrape_errors.labels("serving", "chat", "timeout").inc()
    metrics.scrape_errors.labels("serving", "other", "timeout").inc()
    metrics.forget("serving", "chat")
    text = generate_latest(metrics.registry).decode()
    assert 'inferenceservice="chat"' not in text
    assert 'inferenceservice="other"' in text


async def test_a_status_that_is_not_an_object_starts_afresh(cluster: Cluster) -> None:
    cluster.status = {"autoscaling": "hello"}
    result = await cluster.tick()
    assert [e.reason for e in result.events] == ["AutoscalerStateReset"]
    assert cluster.status["autoscaling"]["decisions"][-1]["reason"] == "ScaleDownStabilizing"
