"""The engines' API keys (spec.engine.apiKeySecret) as the router learns and uses them: read from
the Secret the InferenceService names (kmock's Kubernetes emulator, a real router on loopback in
front of stand-in engines that require the key on every path), sent on the block-event stream and
on proxied requests, a 401 counted and logged without the key, a rotated key used within seconds
by a new replica while a running one keeps the key its engine started with."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from kvpilot.contract.kv_events import Load
from kvpilot.operator.spec import ApiKeySecret
from kvpilot.router.cluster import (
    DEFAULT_API_KEY_SECRET_KEY,
    SecretKeyRef,
    api_key_secret,
    service_info,
)
from kvpilot.router.config import RouterConfig
from kvpilot.router.kube import kube_access
from kvpilot.router.replica import key_to_try
from kvpilot.router.runtime import RouterRuntime

from ..operator.conftest import NAMESPACE
from ..operator.emulated import api
from ..operator.kube_emulator import KubeEmulator
from .loopback import SECRETS_PATH, create_isvc, create_pod, eventually_async, key_secret
from .stand_in import PROMPT, StandIn, serve_runtime, serve_stand_in

MODEL = "keyed"
SECRET = "keyed-engine-key"


def test_the_router_reads_the_secret_key_the_operator_gives_the_engine() -> None:
    assert ApiKeySecret(name="s").key == DEFAULT_API_KEY_SECRET_KEY
    assert api_key_secret("ns", {"name": "s"}) == SecretKeyRef("ns", "s", "api-key")
    assert api_key_secret("ns", {"name": "s", "key": "k"}) == SecretKeyRef("ns", "s", "k")
    assert api_key_secret("ns", {"name": ""}) is None
    assert api_key_secret("ns", None) is None
    obj = {
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": {"engine": {"apiKeySecret": {"name": "s"}}},
    }
    assert service_info(obj).api_key_secret == SecretKeyRef("ns", "s", "api-key")


def test_a_replica_tries_its_accepted_key_first_then_the_others_in_turn() -> None:
    assert key_to_try(("new", "old"), None, 0) == "new"
    assert key_to_try(("new", "old"), None, 1) == "old"
    assert key_to_try(("new", "old"), "old", 0) == "old"  # its engine started before a rotation
    assert key_to_try(("new", "old"), "old", 1) == "new"
    assert key_to_try(("new",), "gone", 0) == "new"
    assert key_to_try((None,), None, 3) is None


def routable(runtime: RouterRuntime) -> set[str]:
    pool = runtime.registry.pools.get(MODEL)
    now = time.monotonic()
    dead_after_s = runtime.config.dead_after_s
    return {
        n for n, r in (pool.replicas if pool else {}).items() if r.is_routable(now, dead_after_s)
    }


@pytest.mark.kmock(cls=KubeEmulator)
@pytest.mark.timeout(60)
async def test_engine_keys_come_from_the_secret_401s_are_visible_and_rotation_works(
    kmock: KubeEmulator, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvpilot.router")
    first = StandIn("first", [], Load(max_num_seqs=8), api_key="sk-engine-old")
    second = StandIn("second", [], Load(max_num_seqs=8), api_key="sk-engine-new")
    config = RouterConfig(namespaces=(NAMESPACE,), engine_key_refresh_s=0.2)
    runtime = RouterRuntime(config, kube_access())

    def counted(name: str, **labels: str) -> float:
        return (
            runtime.metrics.registry.get_sample_value(f"kvpilot_router_{name}_total", labels) or 0
        )

    async with (
        serve_stand_in(first) as first_url,
        serve_stand_in(second) as second_url,
        serve_runtime(runtime) as url,
        httpx.AsyncClient(timeout=10) as http,
    ):
        await create_isvc(kmock, MODEL, MODEL, api_key_secret=SECRET)
        await create_pod(kmock, "keyed-0", MODEL, int(first_url.rsplit(":", 1)[1]))

        # The Secret is not there yet: the engine refuses the stream, and that is seen.
        why = {"namespace": NAMESPACE, "secret": SECRET, "why": "missing"}

        async def refused() -> bool:
            return (
                counted("engine_unauthorized", model=MODEL, path="kv-events") >= 2
                and counted("engine_key_read_errors", **why) >= 1
            )

        await eventually_async(refused, timeout=10)
        assert routable(runtime) == set()
        assert any("refused the router's API key" in r.getMessage() for r in caplog.records)

        # The Secret created: the router reads it and the replica becomes routable.
        await api(kmock, "POST", SECRETS_PATH, key_secret(SECRET, "sk-engine-old"))

        async def first_routable() -> bool:
            return routable(runtime) == {"keyed-0"}

        await eventually_async(first_routable, timeout=10)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        answer = await http.post(f"{url}/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "first"
        assert first.authorizations[-1] == "Bearer sk-engine-old"

        # Rotated: a replica started after it requires the new key, and gets it within
        # seconds; the running one keeps the key its engine started with.
        await api(
            kmock,
            "PATCH",
            f"{SECRETS_PATH}/{SECRET}",
            {"data": key_secret(SECRET, "sk-engine-new")["data"]},
        )
        started = time.monotonic()
        await create_pod(kmock, "keyed-1", MODEL, int(second_url.rsplit(":", 1)[1]))

        async def both_routable() -> bool:
            return routable(runtime) == {"keyed-0", "keyed-1"}

        await eventually_async(both_routable, timeout=10)
        assert time.monotonic() - started < 5
        assert first.authorizations[-1] == "Bearer sk-engine-old"
        assert second.authorizations[-1] == "Bearer sk-engine-new"
        # The old replica gone, requests go to the new one with the new key.
        await api(kmock, "DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/keyed-0")

        async def second_alone() -> bool:
            return routable(runtime) == {"keyed-1"} and "keyed-0" not in (
                runtime.registry.pools[MODEL].replicas
            )

        await eventually_async(second_alone, timeout=10)
        answer = await http.post(f"{url}/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "second"
        assert second.authorizations[-1] == "Bearer sk-engine-new"
        # An engine refusing the router's key on a request: its 401 passes on, and is counted.
        second.api_key = "sk-engine-other"
        refused = await http.post(f"{url}/v1/completions", json=body)
        assert refused.status_code == 401
        assert counted("engine_unauthorized", model=MODEL, path="proxy") == 1
        exported = generate_latest(runtime.metrics.registry).decode()
    # Keys in memory only: not in any log line, not in the metrics.
    for key in ("sk-engine-old", "sk-engine-new"):
        assert not any(key in r.getMessage() for r in caplog.records)
        assert key not in exported
