"""Real processes on loopback for the router tests: `kvpilot serve` replicas started together,
a `kvpilot router` subprocess pointed at kmock's emulator, and the Pod and InferenceService
objects that make the emulator look like a cluster running them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp import web

from kvpilot.router.index import BlockIndex

from ..operator.conftest import ISVC_PATH, NAMESPACE, PODS_PATH
from ..operator.emulated import api
from ..operator.kube_emulator import KubeEmulator
from ..server.serve_process import ServeProcess

SECRETS_PATH = f"/api/v1/namespaces/{NAMESPACE}/secrets"
# Small pools (48 blocks of 16 tokens: about 35 MiB of KV each) so that eviction happens.
ENGINE_ARGS = (
    "--num-gpu-blocks-override", "48", "--block-size", "16", "--max-model-len", "768",
    "--max-num-seqs", "8",
)  # fmt: skip


def start_serve(served_name: str, *args: str) -> ServeProcess:
    """`kvpilot serve` with one torch thread; not waited for (see wait_ready)."""
    cmd = [sys.executable, "-m", "kvpilot.cli", "serve", "--port", "0", "--log-level", "info"]
    cmd += ["--served-model-name", served_name, *ENGINE_ARGS, *args]
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    served = ServeProcess(proc)
    threading.Thread(target=served.read_log, daemon=True).start()
    return served


async def wait_ready(served: ServeProcess, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            assert served.proc.poll() is None, "".join(served.log)
            assert time.monotonic() < deadline, "kvpilot serve did not become ready"
            if served.port is not None:
                try:
                    if (await client.get(f"{served.url}/ready")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            await asyncio.sleep(0.2)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


# The router logs uvicorn's address line as `kvpilot serve` does: the same reader serves both.
RouterProcess = ServeProcess


async def start_router(kubeconfig: Path, *args: str, timeout: float = 60) -> RouterProcess:
    cmd = [sys.executable, "-m", "kvpilot.cli", "router", "--namespace", NAMESPACE]
    cmd += ["--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "KUBECONFIG": str(kubeconfig), "OMP_NUM_THREADS": "1"},
    )
    router = RouterProcess(proc)
    threading.Thread(target=router.read_log, daemon=True).start()
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            assert proc.poll() is None, "".join(router.log)
            assert time.monotonic() < deadline, "the router did not become ready:\n" + "".join(
                router.log
            )
            if router.port is not None:
                try:
                    if (await client.get(f"{router.url}/ready")).status_code == 200:
                        return router
                except httpx.TransportError:
                    pass
            await asyncio.sleep(0.1)


async def create_isvc(
    kmock: KubeEmulator,
    name: str,
    served_name: str,
    *,
    min_replicas: int | None = None,
    annotations: dict[str, str] | None = None,
    adapters: dict[str, Path] | None = None,
    api_key_secret: str | None = None,
) -> None:
    """api_key_secret: the Secret whose `api-key` its engines require (spec.engine.apiKeySecret)."""
    spec: dict[str, Any] = {"model": {"uri": "builtin://smollm2-135m-instruct"}}
    if api_key_secret is not None:
        spec["engine"] = {"apiKeySecret": {"name": api_key_secret}}
    spec["model"]["servedName"] = served_name
    if adapters:
        spec["adapters"] = [{"name": n, "uri": f"file://{p}"} for n, p in adapters.items()]
    if min_replicas is not None:
        spec["autoscaling"] = {"minReplicas": min_replicas, "maxReplicas": 2}
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE, "annotations": annotations or {}},
        "spec": spec,
    }
    await api(kmock, "POST", ISVC_PATH, body)


async def create_pod(kmock: KubeEmulator, name: str, isvc: str, port: int) -> None:
    """An engine pod as the operator's Deployment makes it, Ready at 127.0.0.1:port."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {
                "app.kubernetes.io/name": "kvpilot-engine",
                "app.kubernetes.io/instance": isvc,
            },
        },
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]
        },
    }
    await api(kmock, "POST", PODS_PATH, body)
    status = {
        "status": {
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    }
    await api(kmock, "PATCH", f"{PODS_PATH}/{name}/status", status)


def key_secret(name: str, key: str) -> dict[str, Any]:
    """A Secret holding an engine API key under `api-key` (spec.engine.apiKeySecret's default)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "data": {"api-key": base64.b64encode(key.encode()).decode()},
    }


def isvc_annotations(kmock: KubeEmulator, name: str) -> dict[str, str]:
    key = (kmock.resource("kvpilot.dev/v1alpha1/inferenceservices"), NAMESPACE, name)
    return dict(kmock.objects[key].raw.get("metadata", {}).get("annotations") or {})


async def engine_digest(url: str, api_key: str | None = None) -> str:
    """The digest of the block hashes the engine holds now (its kv-events snapshot)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("GET", f"{url}/kvpilot/v1/kv-events", headers=headers) as response,
    ):
        async for line in response.aiter_lines():
            snapshot = json.loads(line)
            assert snapshot["kind"] == "snapshot"
            index = BlockIndex(1 << 20)
            index.reset(snapshot["hashes"])
            return index.digest()
    raise AssertionError("no snapshot")


async def router_index(router: RouterProcess) -> dict[str, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{router.url}/kvpilot/v1/router/index")).json()


async def eventually_async(check: Any, *, timeout: float = 20.0, interval: float = 0.1) -> Any:
    """Awaits `check()` until it returns something truthy (the loop keeps serving kmock)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met in {timeout} s (last: {last!r})")


class TokenizerGate:
    """A reverse proxy on loopback in front of a real engine, passing everything through as it
    streams (the kv-events stream included) except the tokenizer files, which it holds until
    `opened` is set: a replica whose tokenizer takes as long as the test wants to fetch."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.opened = asyncio.Event()
        self.tokenizer_requests = 0
        self.port = 0
        self._session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/kvpilot/v1/tokenizer/"):
            self.tokenizer_requests += 1
            await self.opened.wait()
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() == "content-type"}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=await request.read(),
            headers=headers,
        ) as upstream:  # fmt: skip
            response = web.StreamResponse(status=upstream.status)
            if "Content-Type" in upstream.headers:
                response.headers["Content-Type"] = upstream.headers["Content-Type"]
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


@contextlib.asynccontextmanager
async def tokenizer_gate(upstream: str) -> AsyncIterator[TokenizerGate]:
    gate = TokenizerGate(upstream)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", gate.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        gate._session = session
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            gate.port = int(runner.addresses[0][1])
            yield gate
        finally:
            gate.opened.set()
            await runner.cleanup()
