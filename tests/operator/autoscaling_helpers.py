"""Engine pods for autoscaler tests: real prometheus_client registries served over loopback HTTP.

Each fake pod listens on its own loopback address (127.0.0.N) and all share one port, as real
pods share the engine port on different pod IPs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from kvpilot.router.metrics import RouterMetrics

MODEL_NAME = "smollm2-135m-instruct"
SLOW_SECONDS = 5.0


class FakeEnginePod:
    """One pod's /metrics. `mode`: ok | slow | error | garbage; gauges changed with set()."""

    def __init__(self, name: str, host: str, prefixes: tuple[str, ...]) -> None:
        self.name = name
        self.host = host
        self.mode = "ok"
        self.num_scrapes = 0
        self.registry = CollectorRegistry()
        self.released = asyncio.Event()  # ends slow answers at teardown
        self._gauges = [
            tuple(
                Gauge(
                    f"{prefix}:{metric}",
                    f"{metric} of the engine",
                    ["model_name"],
                    registry=self.registry,
                )
                for metric in (
                    "num_requests_waiting",
                    "num_requests_running",
                    "kv_cache_usage_perc",
                )
            )
            for prefix in prefixes
        ]
        self.set(waiting=0, kv=0.0)

    def set(self, *, waiting: float, kv: float, running: float = 0.0) -> None:
        for gauge_waiting, gauge_running, gauge_kv in self._gauges:
            gauge_waiting.labels(model_name=MODEL_NAME).set(waiting)
            gauge_running.labels(model_name=MODEL_NAME).set(running)
            gauge_kv.labels(model_name=MODEL_NAME).set(kv)

    async def handle(self, request: web.Request) -> web.Response:
        self.num_scrapes += 1
        if self.mode == "slow":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.released.wait(), SLOW_SECONDS)
        if self.mode == "error":
            return web.Response(status=500, text="engine exploded")
        if self.mode == "garbage":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>")
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


@contextlib.asynccontextmanager
async def serve_pods(
    count: int, prefixes: tuple[str, ...] = ("kvpilot", "vllm")
) -> AsyncIterator[tuple[list[FakeEnginePod], int]]:
    """Starts `count` fake pods on 127.0.0.1..count, one shared free port; yields (pods, port)."""
    for _attempt in range(5):
        pods = [FakeEnginePod(f"engine-{i}", f"127.0.0.{i + 1}", prefixes) for i in range(count)]
        runners: list[web.AppRunner] = []
        try:
            port = 0
            for pod in pods:
                app = web.Application()
                app.router.add_get("/metrics", pod.handle)
                runner = web.AppRunner(app, shutdown_timeout=0.5)
                await runner.setup()
                runners.append(runner)
                site = web.TCPSite(runner, pod.host, port)
                await site.start()
                port = port or runner.addresses[0][1]
        except OSError as exc:
            for runner in runners:
                await runner.cleanup()
            if exc.errno == errno.EADDRINUSE:
                continue  # another process owns the port on some 127.0.0.N: pick another
            raise
        try:
            yield pods, port
        finally:
            for pod in pods:
                pod.released.set()
            for runner in runners:
                await runner.cleanup()
        return
    raise RuntimeError("no free port shared by all loopback addresses")


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_dict(
    name: str,
    ip: str | None,
    *,
    is_ready: bool = True,
    created: float | None = None,
    is_deleting: bool = False,
    phase: str = "Running",
) -> dict[str, Any]:
    """A pod as the Kubernetes API returns it (only the fields the autoscaler reads)."""
    metadata: dict[str, Any] = {"name": name, "namespace": "serving"}
    if created is not None:
        metadata["creationTimestamp"] = iso(created)
    if is_deleting:
        metadata["deletionTimestamp"] = iso(created or 0.0)
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if is_ready else "False"},
        ],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 JSON merge patch, as the API server applies kopf's status patches."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            child = target.get(key)
            if not isinstance(child, dict):
                child = target[key] = {}
            merge_patch(child, value)
        else:
            target[key] = value


class FakeRouterPod:
    """A kvpilot router's /metrics: the router's own RouterMetrics on a real registry, set by the
    test as the router's proxy and registry set them."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics(CollectorRegistry())
        self.num_scrapes = 0
        self.mode = "ok"  # ok | error

    def hold(self, model: str, namespace: str, name: str, held: int, in_flight: int = 0) -> None:
        self.metrics.held.labels(model, namespace, name).set(held)
        self.metrics.in_flight.labels(model, namespace, name).set(in_flight)

    async def handle(self, request: web.Request) -> web.Response:
        self.num_scrapes += 1
        if self.mode == "error":
            return web.Response(status=503, text="router starting")
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


@contextlib.asynccontextmanager
async def serve_routers(count: int) -> AsyncIterator[list[tuple[FakeRouterPod, int]]]:
    """`count` routers' /metrics on 127.0.0.1, each on its own free port: [(router, port)]."""
    routers = [FakeRouterPod() for _ in range(count)]
    runners: list[web.AppRunner] = []
    served = []
    try:
        for router in routers:
            app = web.Application()
            app.router.add_get("/metrics", router.handle)
            runner = web.AppRunner(app, shutdown_timeout=0.5)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            served.append((router, int(runner.addresses[0][1])))
        yield served
    finally:
        for runner in runners:
            await runner.cleanup()


def router_pod_dict(
    name: str, ip: str | None, port: int, *, is_ready: bool = True, namespace: str = "kvpilot"
) -> dict[str, Any]:
    """A router pod as the API returns it: the chart's labels, container and port name."""
    pod = pod_dict(name, ip, is_ready=is_ready)
    pod["metadata"]["namespace"] = namespace
    pod["metadata"]["labels"] = {
        "app.kubernetes.io/name": "kvpilot",
        "app.kubernetes.io/instance": "kvpilot",
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/part-of": "kvpilot",
    }
    pod["spec"] = {
        "containers": [{"name": "router", "ports": [{"name": "http", "containerPort": port}]}]
    }
    return pod
