"""LoRA adapters through the real operator (kopf, our handlers, the kubernetes client) against
kmock's Kubernetes emulator: adding and removing spec.adapters loads and unloads them in the
running replicas, never touching the Deployment.

The test plays the rest of the cluster: the kubelet (engine pods with status.podIP 127.0.0.N,
marked Ready) and the engines. The engines are small aiohttp apps on loopback that keep
vLLM's adapter API and answers (contract/lora.py): /v1/models with `parent`, load 400 for a
name already loaded or bad files and 404 for no adapter at the path, unload 404 for an unknown
name and 409 while in use.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import errno
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from kvpilot.contract.lora import LOAD_LORA_PATH, UNLOAD_LORA_PATH, load_success, unload_success
from kvpilot.operator.config import OperatorConfig

from .conftest import ISVC_PATH, NAMESPACE, PODS_PATH, eventually
from .emulated import (
    DEPLOYMENT,
    ISVC,
    api,
    condition,
    create_isvc,
    events,
    live,
    reasons,
    status_writes,
)
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

NAME = "llm"
SYNC_S = 0.3
SQL = {"name": "sql", "uri": "hf://org/sql-lora"}
CHAT = {"name": "chat-v2", "uri": "file:///adapters/chat"}
BROKEN = {"name": "broken", "uri": "file:///adapters/broken"}
SPEC: dict[str, Any] = {
    "model": {"uri": "builtin://smollm2-135m-instruct"},
    "replicas": 2,
    "engine": {"lora": {"maxLoras": 2}},
    "adapters": [SQL],
}


class FakeEngine:
    """One engine's adapter API, with vLLM's answers."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.loaded: dict[str, str] = {}
        self.in_use: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.api_key: str | None = None

    @web.middleware
    async def auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key is not None and (
            request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            return error(401, "Invalid API key")
        return await handler(request)

    async def models(self, _: web.Request) -> web.Response:
        data = [{"id": NAME, "object": "model", "parent": None, "root": "/models/base"}]
        data += [
            {"id": name, "object": "model", "parent": NAME, "root": path}
            for name, path in self.loaded.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        self.calls.append(("load", name))
        if name in self.loaded and not body.get("load_inplace"):
            return error(400, f"The lora adapter '{name}' has already been loaded.")
        if "broken" in path:
            return error(400, f"{path}/adapter_config.json: target_modules names lm_head")
        self.loaded[name] = path
        return web.Response(text=load_success(name))

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name))
        if name not in self.loaded:
            return error(404, f"The lora adapter '{name}' cannot be found.")
        if name in self.in_use:
            return error(409, f"The lora adapter '{name}' is in use by running requests.")
        del self.loaded[name]
        return web.Response(text=unload_success(name))


def error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
    return web.json_response(body, status=status)


@contextlib.asynccontextmanager
async def serve_engines(count: int) -> AsyncIterator[tuple[list[FakeEngine], int]]:
    """`count` engines on 127.0.0.1..count, one shared free port (as pods share the engine
    port on their own IPs)."""
    for _attempt in range(5):
        engines = [FakeEngine(f"127.0.0.{i + 1}") for i in range(count)]
        runners: list[web.AppRunner] = []
        try:
            port = 0
            for engine in engines:
                app = web.Application(middlewares=[engine.auth])
                app.router.add_get("/v1/models", engine.models)
                app.router.add_post(LOAD_LORA_PATH, engine.load)
                app.router.add_post(UNLOAD_LORA_PATH, engine.unload)
                runner = web.AppRunner(app, shutdown_timeout=0.5)
                await runner.setup()
                runners.append(runner)
                await web.TCPSite(runner, engine.host, port).start()
                port = port or runner.addresses[0][1]
        except OSError as exc:
            for runner in runners:
                await runner.cleanup()
            if exc.errno == errno.EADDRINUSE:
                continue
            raise
        try:
            yield engines, port
        finally:
            for runner in runners:
                await runner.cleanup()
        return
    raise RuntimeError("no free port shared by all loopback addresses")


@pytest.fixture()
async def engines() -> AsyncIterator[tuple[list[FakeEngine], int]]:
    async with serve_engines(3) as served:
        yield served


@pytest.fixture()
def operator_config(
    operator_config: OperatorConfig, engines: tuple[list[FakeEngine], int]
) -> OperatorConfig:
    return dataclasses.replace(
        operator_config,
        adapter_sync_seconds=SYNC_S,
        adapter_load_timeout_seconds=2.0,
        engine_metrics_port=engines[1],
    )


async def add_ready_pod(kmock: KubeEmulator, index: int) -> str:
    """The ReplicaSet's pod, scheduled, and the kubelet marking it Ready on 127.0.0.N."""
    name = f"{NAME}-7c9d-{index}"
    labels = live(kmock, DEPLOYMENT, NAME)["spec"]["selector"]["matchLabels"]  # type: ignore[index]
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}}
    await api(kmock, "POST", PODS_PATH, body)
    status = {
        "phase": "Running",
        "podIP": f"127.0.0.{index + 1}",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    await api(kmock, "PATCH", f"{PODS_PATH}/{name}/status", {"status": status})
    return name


def adapter_status(kmock: KubeEmulator) -> dict[str, dict[str, Any]]:
    status = (live(kmock, ISVC, NAME) or {}).get("status") or {}
    return {adapter["name"]: adapter for adapter in status.get("adapters") or []}


def states(kmock: KubeEmulator, adapter: str) -> dict[str, str]:
    found = adapter_status(kmock).get(adapter) or {}
    return {entry["pod"]: entry["state"] for entry in found.get("replicas") or []}


async def set_adapters(kmock: KubeEmulator, adapters: list[dict[str, Any]]) -> None:
    await api(kmock, "PATCH", f"{ISVC_PATH}/{NAME}", {"spec": {"adapters": adapters}})


@pytest.mark.usefixtures("operator")
async def test_adapters_come_and_go_in_the_running_replicas_without_a_rollout(
    kmock: KubeEmulator, engines: tuple[list[FakeEngine], int]
) -> None:
    fakes, _ = engines
    await create_isvc(kmock, NAME, SPEC)
    await eventually(lambda: live(kmock, DEPLOYMENT, NAME))
    pods = [await add_ready_pod(kmock, 0), await add_ready_pod(kmock, 1)]

    # Every Ready replica gets the spec's adapter.
    await eventually(lambda: all(engine.loaded == {"sql": SQL["uri"]} for engine in fakes[:2]))
    await eventually(lambda: states(kmock, "sql") == dict.fromkeys(pods, "Loaded"))
    await eventually(lambda: condition(kmock, NAME, "AdaptersReady") is not None)
    assert condition(kmock, NAME, "AdaptersReady") == (
        "True", "AdaptersLoaded", "1 adapter(s) loaded on 2 replica(s)"
    )  # fmt: skip
    status = live(kmock, ISVC, NAME)["status"]  # type: ignore[index]
    assert status["adapterSummary"] == "2/2"
    await eventually(lambda: "AdaptersLoaded" in reasons(kmock, NAME))
    before = live(kmock, DEPLOYMENT, NAME)
    assert before is not None

    # Two more, one of them bad: the good one loads, the bad one is a condition and an Event.
    await set_adapters(kmock, [SQL, CHAT, BROKEN])
    await eventually(lambda: all("chat-v2" in engine.loaded for engine in fakes[:2]))
    await eventually(lambda: states(kmock, "broken") == dict.fromkeys(pods, "Failed"))
    ready = await eventually(lambda: condition(kmock, NAME, "AdaptersReady"))
    assert ready[:2] == ("False", "AdapterFailed")
    assert "base model still serves" in ready[2] and "target_modules names lm_head" in ready[2]
    await eventually(lambda: reasons(kmock, NAME).count("AdapterFailed") == 2)
    warnings = [e for e in events(kmock, NAME) if e["reason"] == "AdapterFailed"]
    assert sorted(e["message"].split()[3] for e in warnings) == sorted(pods)
    assert all(e["type"] == "Warning" for e in warnings)
    # Refused loads are not asked again each round (they back off).
    num_loads = sum(call == ("load", "broken") for call in fakes[0].calls)
    await asyncio.sleep(4 * SYNC_S)
    assert sum(call == ("load", "broken") for call in fakes[0].calls) == num_loads == 1
    # The base model's Deployment is as it was: no new template, no rollout.
    after = live(kmock, DEPLOYMENT, NAME)
    assert after is not None
    assert after["spec"]["template"] == before["spec"]["template"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert "Updated" not in reasons(kmock, NAME)

    # A removed adapter still in use on one replica stays Unloading there until it is free.
    fakes[0].in_use.add("sql")
    await set_adapters(kmock, [CHAT])
    await eventually(lambda: "sql" not in fakes[1].loaded)
    await eventually(lambda: states(kmock, "sql") == {pods[0]: "Unloading"})
    assert "sql" in fakes[0].loaded
    assert adapter_status(kmock)["sql"]["replicas"][0]["message"].startswith("HTTP 409: ")
    fakes[0].in_use.clear()
    await eventually(lambda: "sql" not in fakes[0].loaded)
    await eventually(lambda: set(adapter_status(kmock)) == {"chat-v2"})
    await eventually(lambda: (condition(kmock, NAME, "AdaptersReady") or ("",))[0] == "True")

    # Nothing changes, nothing is written: rounds that find the replicas as wanted are quiet.
    writes, calls = status_writes(kmock, NAME), len(fakes[0].calls)
    await asyncio.sleep(4 * SYNC_S)
    assert (status_writes(kmock, NAME), len(fakes[0].calls)) == (writes, calls)

    # A new replica gets every adapter once it is Ready.
    third = await add_ready_pod(kmock, 2)
    await eventually(lambda: fakes[2].loaded == {"chat-v2": "/adapters/chat"})
    await eventually(lambda: states(kmock, "chat-v2") == dict.fromkeys([*pods, third], "Loaded"))

    # No adapter left: every replica unloads, and the status and condition go.
    await set_adapters(kmock, [])
    await eventually(lambda: all(engine.loaded == {} for engine in fakes))
    await eventually(lambda: condition(kmock, NAME, "AdaptersReady") is None)
    status = live(kmock, ISVC, NAME)["status"]  # type: ignore[index]
    assert "adapters" not in status and "adapterSummary" not in status
    assert live(kmock, DEPLOYMENT, NAME)["spec"]["template"] == before["spec"]["template"]  # type: ignore[index]


@pytest.mark.usefixtures("operator")
async def test_an_engine_with_an_api_key_is_called_with_it_once_it_can_be_read(
    kmock: KubeEmulator, engines: tuple[list[FakeEngine], int]
) -> None:
    fakes, _ = engines
    fakes[0].api_key = "s3cret"
    spec = {**SPEC, "replicas": 1, "engine": {"apiKeySecret": {"name": "engine-key"}}}
    await create_isvc(kmock, NAME, spec)
    await eventually(lambda: live(kmock, DEPLOYMENT, NAME))
    pod = await add_ready_pod(kmock, 0)
    ready = await eventually(
        lambda: (
            (condition(kmock, NAME, "AdaptersReady") or ("", ""))[1] == "ApiKeyUnreadable"
            and condition(kmock, NAME, "AdaptersReady")
        )
    )
    assert ready[0] == "False"
    assert "key 'api-key' of Secret serving/engine-key" in ready[2]
    assert "missing or empty" in ready[2]
    await eventually(lambda: "ApiKeyUnreadable" in reasons(kmock, NAME))
    assert fakes[0].calls == []  # never called without the key

    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "engine-key"},
        "data": {"api-key": base64.b64encode(b"s3cret\n").decode()},
    }
    await api(kmock, "POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", secret)
    await eventually(lambda: fakes[0].loaded == {"sql": SQL["uri"]})
    await eventually(lambda: states(kmock, "sql") == {pod: "Loaded"})
    assert "s3cret" not in str(live(kmock, ISVC, NAME))
