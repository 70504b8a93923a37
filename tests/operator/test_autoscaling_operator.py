"""The autoscaler wired into the real operator (kopf, our handlers, the kubernetes client) against
kmock's Kubernetes emulator over HTTP, scraping real HTTP endpoints on loopback that serve
Prometheus text from real prometheus_client registries.

The test plays the rest of the cluster: the ReplicaSet and the kubelet (it writes the engine
pods, with status.podIP 127.0.0.N, and marks them Ready) and the engines (it sets their gauges,
or makes one fail).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.autoscaling.state import parse_time
from kvpilot.operator.config import OperatorConfig

from .autoscaling_helpers import FakeEnginePod, serve_pods
from .chart import operator_rules, rbac_allows
from .conftest import (
    ISVC_PATH,
    PODS_PATH,
    eventually,
    free_ports,
    start_operator,
    stop_operator,
)
from .emulated import DEPLOYMENT, ISVC, api, create_isvc, events, live, rbac_call, reasons
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

NAME = "chat"
INTERVAL_S = 0.5
SCALE_DOWN_WINDOW_S = 3.0
SPEC: dict[str, Any] = {
    "model": {"uri": "builtin://smollm2-135m-instruct"},
    "autoscaling": {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetQueueDepth": 5,
        "intervalSeconds": INTERVAL_S,
        "stableWindowSeconds": 2,
        "panicWindowSeconds": 1,
        "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S},
    },
}


@pytest.fixture()
async def engines() -> AsyncIterator[tuple[list[FakeEnginePod], int]]:
    """Two engine pods' /metrics on 127.0.0.1 and 127.0.0.2, one shared port."""
    async with serve_pods(2, prefixes=("kvpilot",)) as served:
        yield served


@pytest.fixture()
def operator_config(
    operator_config: OperatorConfig, engines: tuple[list[FakeEnginePod], int]
) -> OperatorConfig:
    return dataclasses.replace(
        operator_config,
        autoscale_interval_seconds=INTERVAL_S,
        scrape_timeout_seconds=0.5,
        engine_metrics_port=engines[1],
    )


def pod_name(index: int) -> str:
    return f"{NAME}-5d8f7-{index}"


async def add_pod(kmock: KubeEmulator, index: int, labels: dict[str, str]) -> None:
    """The ReplicaSet creates a pod: scheduled, not Ready yet (pulling, loading the model)."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name(index), "labels": labels},
    }
    await api(kmock, "POST", PODS_PATH, body)
    status = {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}
    await api(kmock, "PATCH", f"{PODS_PATH}/{pod_name(index)}/status", {"status": status})


async def make_ready(kmock: KubeEmulator, index: int, ip: str) -> None:
    status = {
        "phase": "Running",
        "podIP": ip,
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    await api(kmock, "PATCH", f"{PODS_PATH}/{pod_name(index)}/status", {"status": status})


def replicas(kmock: KubeEmulator) -> int:
    return live(kmock, DEPLOYMENT, NAME)["spec"]["replicas"]  # type: ignore[index]


def autoscaling(kmock: KubeEmulator) -> dict[str, Any]:
    return live(kmock, ISVC, NAME)["status"]["autoscaling"]  # type: ignore[index]


def last_reason(kmock: KubeEmulator) -> str:
    return autoscaling(kmock)["decisions"][-1]["reason"]


def event_with(kmock: KubeEmulator, reason: str) -> dict[str, Any]:
    return next(e for e in events(kmock, NAME) if e["reason"] == reason)


async def operator_metrics(config: OperatorConfig) -> dict[tuple[str, tuple[Any, ...]], float]:
    """The operator's own /metrics, over HTTP: {(sample name, sorted labels): value}."""
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.get(f"http://127.0.0.1:{config.metrics_port}/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def series(namespace: str, **labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"namespace": namespace, "inferenceservice": NAME, **labels}.items()))


def writes_spec(request: Any) -> bool:
    """Whether a request of the operator could change the InferenceService's spec."""
    if request.subresource == "scale":
        return True
    data = request.data
    if isinstance(data, dict):
        return "spec" in data
    return any(str(op.get("path", "")).startswith("/spec") for op in data or [])


async def test_replicas_follow_the_engines_queue(
    kmock: KubeEmulator,
    kubeconfig: Any,
    operator_config: OperatorConfig,
    engines: tuple[list[FakeEnginePod], int],
) -> None:
    fakes, _ = engines
    running = await start_operator(operator_config)
    try:
        await create_isvc(kmock, NAME, SPEC)
        deployment = await eventually(lambda: live(kmock, DEPLOYMENT, NAME))
        assert deployment["spec"]["replicas"] == 1  # minReplicas
        namespace = deployment["metadata"]["namespace"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        await add_pod(kmock, 0, labels)
        await make_ready(kmock, 0, fakes[0].host)
        await eventually(lambda: autoscaling(kmock)["metrics"]["reportingPods"] == 1)
        assert replicas(kmock) == 1
        assert fakes[0].num_scrapes > 0  # over HTTP, from the operator's thread

        # A rising queue: 10 waiting on one pod at a target of 5 is twice the target -> panic,
        # and the Deployment (never the spec) goes to 2 at once.
        fakes[0].set(waiting=10, kv=0.3, running=8)
        await eventually(lambda: replicas(kmock) == 2, timeout=10)
        # First the Deployment, then the status that records why.
        await eventually(lambda: autoscaling(kmock)["decisions"][-1]["toReplicas"] == 2)
        state = autoscaling(kmock)
        scale_up = state["decisions"][-1]
        assert (scale_up["fromReplicas"], scale_up["toReplicas"]) == (1, 2)
        # Panic when the ticks come on time; on a busy machine the stable window may act first.
        assert scale_up["reason"] in ("PanicScaleUp", "ScaleUp")
        assert state["lastScaleTime"] == scale_up["time"]
        assert live(kmock, ISVC, NAME)["status"]["desiredReplicas"] == 2  # type: ignore[index]
        await eventually(lambda: "ScaledUp" in reasons(kmock, NAME))
        scaled_up = event_with(kmock, "ScaledUp")
        assert scaled_up["type"] == "Normal"
        assert scaled_up["message"].startswith(f"1 -> 2 replicas ({scale_up['reason']}): load")

        # The new replica is starting: more load waits for it instead of scaling again.
        await add_pod(kmock, 1, labels)
        fakes[0].set(waiting=20, kv=0.5, running=8)
        await eventually(lambda: last_reason(kmock) == "WaitingForStartingPods", timeout=10)
        assert autoscaling(kmock)["metrics"]["startingPods"] == 1
        assert replicas(kmock) == 2
        # The queue spreads over both pods once the new one is Ready (first let the windows
        # forget the lone pod's backlog, as the Service would have spread it meanwhile).
        fakes[0].set(waiting=5, kv=0.4, running=8)
        await eventually(
            lambda: {load for _, load in autoscaling(kmock)["window"]["samples"]} == {1.0},
            timeout=10,
        )
        fakes[1].set(waiting=5, kv=0.4, running=8)
        await make_ready(kmock, 1, fakes[1].host)
        await eventually(lambda: autoscaling(kmock)["metrics"]["reportingPods"] == 2)
        assert autoscaling(kmock)["metrics"]["numRequestsWaiting"] == 10
        assert replicas(kmock) == 2

        # The operator's own /metrics counted the scale-up.
        metrics = await operator_metrics(running.config)
        up = series(namespace, direction="up")
        assert metrics[("kvpilot_operator_scale_decisions_total", up)] == 1
        assert metrics[("kvpilot_operator_desired_replicas", series(namespace))] == 2
        assert metrics[("kvpilot_operator_current_replicas", series(namespace))] == 2
        assert metrics[("kvpilot_operator_max_replicas", series(namespace))] == 3
        assert metrics[("kvpilot_operator_saturation", series(namespace))] > 0

        # An operator restart keeps the windows and decisions: they live in status.
        await stop_operator(running)
        restarted_at = time.time()
        metrics_port, liveness_port = free_ports(2)
        running = await start_operator(
            dataclasses.replace(
                operator_config,
                metrics_port=metrics_port,
                liveness_endpoint=f"http://127.0.0.1:{liveness_port}/healthz",
            )
        )
        await eventually(lambda: parse_time(autoscaling(kmock)["observedAt"]) > restarted_at)
        assert scale_up in autoscaling(kmock)["decisions"]  # a fresh state would have none
        assert replicas(kmock) == 2

        # The queue drains, but one pod's /metrics fails: no scale-down while it is missing,
        # even once the scale-down window would allow one.
        drained_at = time.time()
        fakes[1].mode = "error"
        fakes[0].set(waiting=0, kv=0.05)
        await eventually(lambda: "MetricsUnavailable" in reasons(kmock, NAME))
        unavailable = event_with(kmock, "MetricsUnavailable")
        assert unavailable["type"] == "Warning"
        assert pod_name(1) in unavailable["message"] and "HTTP 500" in unavailable["message"]
        assert autoscaling(kmock)["metrics"]["missingPods"] == [pod_name(1)]
        await eventually(lambda: last_reason(kmock) == "MissingMetrics", timeout=10)
        # (the window counts from the last tick that still saw the load, up to a tick earlier)
        assert time.time() - drained_at >= SCALE_DOWN_WINDOW_S - 2 * INTERVAL_S
        assert replicas(kmock) == 2

        # It reports again: the drained queue lowers the replicas at once (the window is full).
        fakes[1].set(waiting=0, kv=0.05)
        fakes[1].mode = "ok"
        await eventually(lambda: replicas(kmock) == 1, timeout=10)
        await eventually(lambda: autoscaling(kmock)["decisions"][-1]["toReplicas"] == 1)
        state = autoscaling(kmock)
        scale_down = state["decisions"][-1]
        assert (scale_down["fromReplicas"], scale_down["toReplicas"], scale_down["reason"]) == (
            2,
            1,
            "ScaleDown",
        )
        assert state["lastScaleTime"] == scale_down["time"]
        assert len(state["decisions"]) <= 5
        assert state["mode"] == "stable"
        await eventually(lambda: {"ScaledDown", "MetricsRecovered"} <= set(reasons(kmock, NAME)))
        assert event_with(kmock, "ScaledDown")["message"].startswith("2 -> 1 replicas (ScaleDown)")
        await eventually(lambda: live(kmock, ISVC, NAME)["status"]["desiredReplicas"] == 1)  # type: ignore[index]

        metrics = await operator_metrics(running.config)
        down = series(namespace, direction="down")
        assert metrics[("kvpilot_operator_scale_decisions_total", down)] == 1
        errors = series(namespace, kind="http_status")
        assert metrics[("kvpilot_operator_scrape_errors_total", errors)] >= 1
        assert metrics[("kvpilot_operator_reconcile_duration_seconds_count", ())] > 0
        assert metrics[("kvpilot_operator_autoscale_tick_duration_seconds_count", ())] > 0
    finally:
        if running.thread.is_alive():
            await stop_operator(running)

    # The user's spec was never written: same spec, same generation, no write touching it.
    isvc = live(kmock, ISVC, NAME)
    assert isvc is not None
    assert isvc["spec"] == SPEC
    assert isvc["metadata"]["generation"] == 1
    own_writes = [
        r
        for r in kmock._requests
        if r.method in ("PATCH", "PUT")
        and str(r.url.path).startswith(f"{ISVC_PATH}/{NAME}")
        and not r.headers.get("User-Agent", "").startswith("kmock/")
    ]
    assert own_writes, "the operator wrote status"
    assert [r.url.path for r in own_writes if writes_spec(r)] == []

    # Every API call the autoscaler made is allowed by the chart's ClusterRole.
    rules = operator_rules()
    calls = {call for call in map(rbac_call, kmock._requests) if call is not None}
    assert ("", "pods", "list") in calls
    assert sorted(call for call in calls if not rbac_allows(rules, *call)) == []
