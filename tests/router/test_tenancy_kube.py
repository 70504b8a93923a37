"""Tenants from the Kubernetes API (kmock's emulator): a real router (uvicorn on loopback) lists
and watches Tenants and the Secrets they name, in front of a stand-in engine replica. A key works
once its Secret exists, a rotated key replaces the old one within a watch event, a deleted Tenant
locks its keys out, and the router writes a quota'd tenant's window use into its status."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.contract.kv_events import Load
from kvpilot.router.config import RouterConfig, TenancyConfig
from kvpilot.router.kube import kube_access

from ..operator.conftest import NAMESPACE
from ..operator.emulated import api
from ..operator.kube_emulator import KubeEmulator
from .loopback import create_isvc, create_pod
from .stand_in import PROMPT, StandIn, serve_router, serve_stand_in

pytestmark = [pytest.mark.kmock(cls=KubeEmulator), pytest.mark.timeout(120)]

TENANTS_PATH = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/tenants"
SECRETS_PATH = f"/api/v1/namespaces/{NAMESPACE}/secrets"
MODEL = "base"


def secret(name: str, key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "data": {"api-key": base64.b64encode(key.encode()).decode()},
    }


def tenant(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"apiKeys": [{"name": f"{name}-keys"}], "models": [MODEL], **spec},
    }


async def status_with(http: httpx.AsyncClient, url: str, key: str) -> int:
    response = await http.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1},
        headers={"Authorization": f"Bearer {key}"},
    )
    return response.status_code


async def until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.05)


async def test_tenants_and_keys_follow_the_api_and_usage_lands_in_status(
    kmock: KubeEmulator, kubeconfig: Path
) -> None:
    engine = StandIn("a", [], Load(max_num_seqs=8))
    async with serve_stand_in(engine) as engine_url:
        await create_isvc(kmock, MODEL, MODEL)
        await create_pod(kmock, "base-0", MODEL, int(engine_url.rsplit(":", 1)[1]))
        await api(kmock, "POST", TENANTS_PATH, tenant("alpha", quota={"requestsPerMinute": 100}))
        config = RouterConfig(namespaces=(NAMESPACE,), tenancy=TenancyConfig(status_interval_s=0.2))
        async with (
            serve_router(config, kube_access()) as url,
            httpx.AsyncClient(timeout=10) as http,
        ):

            async def ready() -> bool:
                return (await http.get(f"{url}/ready")).status_code == 200

            await until(ready)
            # The Tenant names a Secret that is not there yet: no key works.
            assert await status_with(http, url, "sk-first") == 401
            await api(kmock, "POST", SECRETS_PATH, secret("alpha-keys", "sk-first"))

            async def works(key: str) -> bool:
                return await status_with(http, url, key) == 200

            await until(lambda: works("sk-first"))
            # The engine sees the tenant's priority and salt, never the tenant's key.
            forwarded = engine.bodies[-1]
            assert forwarded["priority"] == 0
            assert forwarded["cache_salt"] == f"tenant:{NAMESPACE}/alpha"
            # Rotation: the Secret's value replaced.
            rotated = secret("alpha-keys", "sk-second")
            await api(kmock, "PATCH", f"{SECRETS_PATH}/alpha-keys", {"data": rotated["data"]})
            started = time.monotonic()
            await until(lambda: works("sk-second"))
            assert time.monotonic() - started < 5
            assert await status_with(http, url, "sk-first") == 401

            async def usage_written() -> bool:
                obj = await api(kmock, "GET", f"{TENANTS_PATH}/alpha")
                usage = (obj.get("status") or {}).get("usage") or {}
                return usage.get("requests", 0) >= 2

            await until(usage_written)
            usage = (await api(kmock, "GET", f"{TENANTS_PATH}/alpha"))["status"]["usage"]
            assert usage["reportedBy"] == config.router_name
            assert usage["windowStart"].endswith("Z") and usage["tokens"] > 0

            await api(kmock, "DELETE", f"{TENANTS_PATH}/alpha")

            async def locked_out() -> bool:
                return await status_with(http, url, "sk-second") == 401

            await until(locked_out)
