"""Fixtures that run the real operator (kopf + our handlers) against kmock's emulator over HTTP."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from kvpilot.operator.cli import run_operator
from kvpilot.operator.config import OperatorConfig

from .kube_emulator import KubeEmulator

NAMESPACE = "serving"
ENGINE_IMAGE = "registry.example/kvpilot:test"
ISVC_PATH = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"
DEPLOYMENTS_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
SERVICES_PATH = f"/api/v1/namespaces/{NAMESPACE}/services"
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Distinct free ports: all sockets are held until every port is known (two calls of a
    one-port helper can get the same port back, which once failed the metrics-vs-liveness check)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture()
def kubeconfig(kmock: KubeEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Points every client (kopf's login, our KubeApi) at the emulator."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                "users": [{"name": "tester", "user": {"token": "any"}}],
                "contexts": [
                    {
                        "name": "kmock",
                        "context": {"cluster": "kmock", "user": "tester", "namespace": NAMESPACE},
                    }
                ],
                "current-context": "kmock",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # The kubernetes client reads $KUBECONFIG once, at import; kopf's login uses that constant.
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    return path


@dataclass
class RunningOperator:
    config: OperatorConfig
    thread: threading.Thread
    stop: threading.Event


@pytest.fixture()
def operator_config() -> OperatorConfig:
    liveness_port, metrics_port = free_ports(2)
    return OperatorConfig(
        namespaces=(NAMESPACE,),
        engine_image=ENGINE_IMAGE,
        resync_seconds=1.0,
        liveness_endpoint=f"http://127.0.0.1:{liveness_port}/healthz",
        max_workers=4,
        metrics_port=metrics_port,
    )


async def start_operator(config: OperatorConfig) -> RunningOperator:
    """The operator as `kvpilot operator` runs it, in a thread (the test loop serves the API)."""
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=run_operator,
        args=(config,),
        kwargs={"stop_flag": stop, "ready_flag": ready},
        daemon=True,
    )
    thread.start()
    assert await asyncio.to_thread(ready.wait, 20), "the operator did not get ready"
    return RunningOperator(config, thread, stop)


async def stop_operator(running: RunningOperator) -> None:
    running.stop.set()
    await asyncio.to_thread(running.thread.join, 20)
    assert not running.thread.is_alive(), "the operator did not stop"


@pytest.fixture()
async def operator(
    kubeconfig: Path, operator_config: OperatorConfig
) -> AsyncIterator[RunningOperator]:
    running = await start_operator(operator_config)
    yield running
    await stop_operator(running)


async def eventually(
    check: Callable[[], Any], *, timeout: float = 20.0, interval: float = 0.05
) -> Any:
    """Polls `check` (truthy result wins) while the event loop keeps serving the emulator."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (KeyError, AssertionError, ValueError, TypeError) as error:
            last_error = error
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met in {timeout}s (last error: {last_error!r})")
