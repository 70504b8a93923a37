"""A queue at the router is a queue: the real operator (kopf + our handlers) against kmock, a
kvpilot router's /metrics (the router's own RouterMetrics registry) served over loopback HTTP
from a router pod it finds by its labels, and an engine pod's /metrics likewise.

Requests held at the router wake a service at zero with no wake annotation, and held on top of
a saturated replica they scale it up to maxReplicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvpilot.contract.kube import ANNOTATION_WAKE
from kvpilot.operator.config import OperatorConfig

from .autoscaling_helpers import (
    FakeEnginePod,
    FakeRouterPod,
    router_pod_dict,
    serve_pods,
    serve_routers,
)
from .conftest import NAMESPACE, PODS_PATH, eventually, start_operator, stop_operator
from .emulated import DEPLOYMENT, ISVC, api, create_isvc, live, reasons
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

NAME = "queued"
INTERVAL_S = 0.5
SPEC: dict[str, Any] = {
    "model": {"uri": "builtin://smollm2-135m-instruct"},
    "autoscaling": {
        "minReplicas": 0,
        "maxReplicas": 2,
        "targetQueueDepth": 5,
        "intervalSeconds": INTERVAL_S,
        "stableWindowSeconds": 2,
        "panicWindowSeconds": 1,
        "scaleToZeroAfterSeconds": 600,
    },
}


@pytest.fixture()
async def engines() -> AsyncIterator[tuple[list[FakeEnginePod], int]]:
    async with serve_pods(1, prefixes=("kvpilot",)) as served:
        yield served


@pytest.fixture()
async def routers() -> AsyncIterator[list[tuple[FakeRouterPod, int]]]:
    async with serve_routers(1) as served:
        yield served


def replicas(kmock: KubeEmulator) -> int | None:
    deployment = live(kmock, DEPLOYMENT, NAME)
    return None if deployment is None else deployment["spec"].get("replicas")


def autoscaling(kmock: KubeEmulator) -> dict[str, Any]:
    return live(kmock, ISVC, NAME)["status"]["autoscaling"]  # type: ignore[index]


async def add_ready_pod(kmock: KubeEmulator, pod: dict[str, Any], ip: str) -> None:
    name = pod["metadata"]["name"]
    await api(kmock, "POST", PODS_PATH, pod)
    status = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    await api(kmock, "PATCH", f"{PODS_PATH}/{name}/status", {"status": status})


async def test_requests_held_at_the_router_wake_and_scale_the_service(
    kmock: KubeEmulator,
    kubeconfig: Any,
    operator_config: OperatorConfig,
    engines: tuple[list[FakeEnginePod], int],
    routers: list[tuple[FakeRouterPod, int]],
) -> None:
    fakes, engine_port = engines
    ((router, router_port),) = routers
    config = dataclasses.replace(
        operator_config,
        autoscale_interval_seconds=INTERVAL_S,
        scrape_timeout_seconds=0.5,
        engine_metrics_port=engine_port,
        router_namespace=NAMESPACE,
        router_selector="app.kubernetes.io/component=router,app.kubernetes.io/instance=kvpilot",
    )
    # The router pod: found by its labels, scraped at its container's port.
    await add_ready_pod(
        kmock,
        router_pod_dict("kvpilot-router-0", None, router_port, namespace=NAMESPACE),
        "127.0.0.1",
    )
    running = await start_operator(config)
    try:
        await create_isvc(kmock, NAME, SPEC)
        await eventually(lambda: replicas(kmock) == 0)
        await eventually(lambda: autoscaling(kmock)["metrics"]["routerHeldRequests"] == 0)
        assert router.num_scrapes > 0
        assert replicas(kmock) == 0  # nothing held, nothing reported: zero stays zero

        # Three requests held at the router, and no wake annotation: the tick wakes it.
        router.hold(NAME, NAMESPACE, NAME, held=3)
        await eventually(lambda: replicas(kmock) == 1, timeout=10)
        assert ANNOTATION_WAKE not in (live(kmock, ISVC, NAME)["metadata"].get("annotations") or {})
        await eventually(lambda: autoscaling(kmock)["decisions"][-1]["reason"] == "ScaleFromZero")
        assert autoscaling(kmock)["metrics"]["routerHeldRequests"] == 3
        await eventually(lambda: "ScaledUp" in reasons(kmock, NAME))

        # The replica is Ready and exactly at target (5 waiting), and the router still holds 10
        # (its routes not synced yet, say): load 1 + 10/5 = 3 on one pod, panic, up to max 2.
        deployment = live(kmock, DEPLOYMENT, NAME)
        labels = deployment["spec"]["template"]["metadata"]["labels"]  # type: ignore[index]
        fakes[0].set(waiting=5, kv=0.1)
        router.hold(NAME, NAMESPACE, NAME, held=10, in_flight=4)
        engine_pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{NAME}-0", "labels": labels},
        }
        await add_ready_pod(kmock, engine_pod, fakes[0].host)
        await eventually(lambda: replicas(kmock) == 2, timeout=10)
        await eventually(lambda: autoscaling(kmock)["decisions"][-1]["toReplicas"] == 2)
        state = autoscaling(kmock)
        assert state["decisions"][-1]["reason"] in ("PanicScaleUp", "ScaleUp")
        assert "10 requests held at the routers" in state["decisions"][-1]["message"]
        assert state["metrics"]["routerInFlightRequests"] == 4
    finally:
        await stop_operator(running)
