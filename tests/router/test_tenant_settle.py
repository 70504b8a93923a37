"""A tenant's request settles to what it really used, and gives its replica slot back, whatever
becomes of it: shed from the fair queue, its client gone before the replica answered, gone
before the first byte of a stream (Starlette never iterates the body then), gone mid-stream, a
replica that refuses it. And a worse class's requests declare a better class active on the
model to the engine (its guard then holds before the better class's next request). A real
router (uvicorn on loopback, its tenants from a file) charging a real redis-server, in front of
a stand-in replica that answers when the test says."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web

from kvpilot.contract.kv_events import Load
from kvpilot.contract.tenancy import Quota
from kvpilot.router.config import RouterConfig, TenancyConfig
from kvpilot.router.openai_routes import OpenAIRoutes
from kvpilot.router.quota import QuotaKeeper, Scope, Usage, tenant_scope_key
from kvpilot.router.replica import Replica
from kvpilot.router.runtime import RouterRuntime

from ..redis_server import RedisServer
from .stand_in import PROMPT, StandIn, serve_runtime, serve_stand_in

pytestmark = pytest.mark.timeout(60)

NS = "teams"
KEY = "sk-metered-0"
PREMIUM_KEY = "sk-premium-0"
BATCH_KEY = "sk-batch-0"
SCOPE = tenant_scope_key(NS, "metered")
COMPLETION_TOKENS = 3


class GatedStreams(StandIn):
    """Answers streams: its status line once `answer` is set, then COMPLETION_TOKENS tokens and
    the usage chunk once `body` is set; 400 for a prompt of one token."""

    def __init__(self) -> None:
        super().__init__("a", [], Load(max_num_seqs=16))
        self.answer = asyncio.Event()
        self.body = asyncio.Event()
        self.arrived = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrived.set()
        if len(body["prompt"]) == 1:
            return web.json_response({"error": {"message": "no"}}, status=400)
        await self.answer.wait()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await self.body.wait()
        for i in range(COMPLETION_TOKENS):
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}], "usage": None}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": COMPLETION_TOKENS}
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
        await response.write(b"\n\ndata: [DONE]\n\n")
        return response


def tenant_documents(name: str, key: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
    tenant = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"apiKeys": [{"name": f"{name}-keys"}], "models": ["base"], **spec},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-keys", "namespace": NS},
        "data": {"k0": base64.b64encode(key.encode()).decode()},
    }
    return [tenant, secret]


def tenants_yaml() -> str:
    return yaml.safe_dump_all(
        [
            *tenant_documents(
                "metered", KEY, {"quota": {"tokensPerMinute": 100_000, "maxConcurrent": 10}}
            ),
            *tenant_documents("premium", PREMIUM_KEY, {"priorityClass": "critical"}),
            *tenant_documents("batch", BATCH_KEY, {"priorityClass": "best-effort"}),
        ]
    )


@dataclass
class Setup:
    url: str
    redis_url: str
    runtime: RouterRuntime
    engine: GatedStreams
    http: httpx.AsyncClient

    @property
    def replica(self) -> Replica:
        (replica,) = self.runtime.registry.pools["base"].replicas.values()
        return replica

    async def usage(self) -> Usage:
        assert self.runtime.quotas is not None
        return await self.runtime.quotas.usage(SCOPE)

    async def settled(self, tokens: int) -> None:
        """Wait until nothing is in flight and the quota's tokens are `tokens` (the settle runs
        after the response)."""
        for _ in range(200):
            if self.replica.in_flight == 0 and await self.usage() == Usage(1, tokens, 0):
                return
            await asyncio.sleep(0.02)
        assert (self.replica.in_flight, await self.usage()) == (0, Usage(1, tokens, 0))

    def body(self, prompt: list[int] = PROMPT) -> dict[str, Any]:
        return {"model": "base", "prompt": prompt, "max_tokens": 8, "stream": True}

    def post(
        self, body: dict[str, Any] | None = None, key: str = KEY
    ) -> asyncio.Task[httpx.Response]:
        headers = {"authorization": f"Bearer {key}"}
        request = self.http.post(
            f"{self.url}/v1/completions", json=body or self.body(), headers=headers, timeout=30
        )
        return asyncio.ensure_future(request)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    redis = RedisServer(tmp_path)
    redis.start()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(tenants_yaml())
    engine = GatedStreams()
    try:
        async with serve_stand_in(engine) as engine_url:
            tenancy = TenancyConfig(
                quota_store_url=redis.url,
                tenants_file=str(tenants_file),
                replica_concurrency=1,
                max_queued_per_model=0,  # a second request while one is in flight: shed
            )
            config = RouterConfig(
                namespaces=(), static_models=(("base", (engine_url,)),), tenancy=tenancy
            )
            runtime = RouterRuntime(config, None)
            async with serve_runtime(runtime) as url, httpx.AsyncClient() as http:
                yield Setup(url, redis.url, runtime, engine, http)
    finally:
        redis.stop()


async def test_a_shed_request_and_one_whose_client_left_early_are_refunded(setup: Setup) -> None:
    first = setup.post()
    await setup.engine.arrived.wait()  # admitted: its prompt is charged, the replica is full
    assert setup.replica.in_flight == 1
    charged = (await setup.usage()).tokens
    assert charged > 0

    shed = await setup.post()
    assert shed.status_code == 429 and shed.json()["error"]["code"] == "queue_full"
    for _ in range(100):  # its settle runs after the answer
        if await setup.usage() == Usage(2, charged, 1):
            break
        await asyncio.sleep(0.02)
    assert await setup.usage() == Usage(2, charged, 1)  # its prompt given back

    first.cancel()  # the client leaves before the replica sent its status line
    for _ in range(200):
        if setup.replica.in_flight == 0 and await setup.usage() == Usage(2, 0, 0):
            break
        await asyncio.sleep(0.02)
    assert (setup.replica.in_flight, await setup.usage()) == (0, Usage(2, 0, 0))


async def test_a_refused_request_is_refunded_and_a_served_one_charged_its_usage(
    setup: Setup,
) -> None:
    refused = await setup.post(setup.body(prompt=[7]))
    assert refused.status_code == 400
    await setup.settled(0)

    setup.engine.answer.set()
    setup.engine.body.set()
    served = await setup.post()
    assert served.status_code == 200 and "[DONE]" in served.text
    for _ in range(200):
        if (await setup.usage()).tokens == len(PROMPT) + COMPLETION_TOKENS:
            break
        await asyncio.sleep(0.02)
    assert await setup.usage() == Usage(2, len(PROMPT) + COMPLETION_TOKENS, 0)
    assert setup.replica.in_flight == 0


async def test_a_client_gone_mid_stream_pays_its_prompt_and_what_streamed(setup: Setup) -> None:
    setup.engine.answer.set()
    headers = {"authorization": f"Bearer {KEY}"}
    async with setup.http.stream(
        "POST", f"{setup.url}/v1/completions", json=setup.body(), headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        setup.engine.body.set()
        async for _ in response.aiter_bytes():
            break  # the client leaves after its first bytes
    # What the router saw stream is charged (the engine's usage when it came first), the
    # prompt too: it was served.
    for _ in range(200):
        used = await setup.usage()
        if setup.replica.in_flight == 0 and used.concurrent == 0:
            break
        await asyncio.sleep(0.02)
    assert setup.replica.in_flight == 0
    assert used.concurrent == 0
    assert len(PROMPT) <= used.tokens <= len(PROMPT) + COMPLETION_TOKENS


async def test_worse_classes_declare_a_better_class_recently_active(setup: Setup) -> None:
    setup.engine.answer.set()
    setup.engine.body.set()
    for key in (BATCH_KEY, PREMIUM_KEY, BATCH_KEY, KEY, PREMIUM_KEY):
        answer = await setup.post(key=key)
        assert answer.status_code == 200, answer.text
    declared = [body.get("kvpilot_guard_priority") for body in setup.engine.bodies]
    priorities = [body["priority"] for body in setup.engine.bodies]
    assert priorities == [1, -2, 1, 0, -2]
    # Best-effort before any critical request: nothing to declare; after one, every worse
    # class declares critical's engine priority; critical itself never declares.
    assert declared == [None, None, -2, -2, None]


async def test_a_request_ahead_of_its_quota_answer_is_never_served_when_refused(
    setup: Setup,
) -> None:
    setup.engine.answer.set()
    setup.engine.body.set()
    first = await setup.post()  # no answer from the store yet for this tenant: checked first
    assert first.status_code == 200 and first.headers["x-ratelimit-limit-tokens"] == "100000"
    assert setup.runtime.quotas is not None
    scopes = [Scope(SCOPE, Quota(tokens_per_minute=100_000, max_concurrent=10))]
    assert setup.runtime.quotas.has_headroom(scopes, len(PROMPT))
    ahead = await setup.post()  # goes ahead of its answer; admitted: served, with its headers
    assert ahead.status_code == 200 and "[DONE]" in ahead.text
    assert int(ahead.headers["x-ratelimit-remaining-tokens"]) < 100_000 - len(PROMPT)

    # Another router spends the budget: this router's view still shows headroom.
    other = QuotaKeeper(setup.redis_url)
    await other.start()
    try:
        spent = await other.admit(scopes, 99_900, "open")
        assert spent.admitted
        await other.settle(spent.lease, 0)
    finally:
        await other.stop()
    before = await setup.usage()
    served = len(setup.engine.bodies)
    refused = await setup.post()
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "data:" not in refused.text  # nothing of the replica's answer
    assert len(setup.engine.bodies) == served + 1  # it went ahead, then was dropped
    for _ in range(100):
        if setup.replica.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert setup.replica.in_flight == 0
    assert await setup.usage() == before  # the store charged none of it
    # Near the limit now: the next one is checked before it goes anywhere.
    assert not setup.runtime.quotas.has_headroom(scopes, len(PROMPT))
    again = await setup.post()
    assert again.status_code == 429 and len(setup.engine.bodies) == served + 1


@pytest.mark.parametrize("asgi_spec", ["2.3", "2.4"])
async def test_a_stream_dropped_before_its_first_byte_gives_its_slot_back(
    setup: Setup, asgi_spec: str
) -> None:
    """The router's ASGI app driven directly, as uvicorn drives it, by a client that is gone
    when the response starts: under ASGI 2.4 the server's send raises (OSError), under 2.3
    Starlette sees the disconnect and cancels the response before it iterates the body."""
    setup.engine.answer.set()
    await setup.http.get(f"{setup.url}/health")  # the router is up (the fixture waited)
    payload = json.dumps(setup.body()).encode()
    received = 0
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": payload, "more_body": False}
        if asgi_spec == "2.3" and received >= 3:  # Starlette's own disconnect listener
            return {"type": "http.disconnect"}
        await never.wait()  # the router's wait while the request is handled
        raise AssertionError("unreachable")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if asgi_spec == "2.4":
            raise OSError("the client is gone")
        await never.wait()  # a write that never completes: the disconnect cancels it

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": asgi_spec},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [
            (b"authorization", f"Bearer {KEY}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    # The same front create_app serves, on the same runtime (its fallback app not needed).
    routes = OpenAIRoutes(app_fallback, setup.runtime.proxy, setup.runtime.config.max_body_bytes)
    try:
        await asyncio.wait_for(routes(scope, receive, send), timeout=20)
    except Exception as exc:  # Starlette's ClientDisconnect under 2.4
        assert asgi_spec == "2.4", exc
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert setup.engine.bodies  # it reached the replica
    await setup.settled(0)  # slot back, concurrency released, the prompt never served


async def app_fallback(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("only the OpenAI routes are driven")
