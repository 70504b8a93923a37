"""Tenants end to end, real parts only: two `kvpilot router` processes sharing a real
redis-server (Debian's) in front of one real `kvpilot serve` of the bundled SmolLM2 (priority
scheduling), tenants from a manifests file:

- 401 without or with a wrong key, 403 for a model not granted (alike whether it exists), 200 with
  OpenAI's rate-limit headers through the `openai` client;
- a rotated key works and the old one stops on both routers within seconds;
- a token quota holds across both routers (within 10 %), a request quota exactly; 429 with
  Retry-After and the headers;
- the cache is salted per tenant (no cross-tenant prefix hit) except a platform-shared prefix;
- a critical tenant's request overtakes a best-effort tenant's queue;
- a store that goes away: a tenant that fails closed gets 503, one that fails open is served;
- 1,000 generated requests (keys, headers, model names, bodies): no 5xx, and nothing served to a
  tenant its grants do not allow.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract.tenancy import is_granted

from ..redis_server import RedisServer
from ..server.serve_process import ServeProcess
from .loopback import start_serve, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smol"
# A model the router serves (its engine is another process's name: never answered 200), granted
# to nobody but `ops`.
HIDDEN = "hidden"
NS = "teams"
SHARED_SYSTEM = (
    "You are the assistant of the platform. Answer in one short sentence, politely, and never "
    "invent facts. Refuse to discuss the weather, sports, or politics. Keep every answer under "
    "twenty words. Use plain language that a child understands. Do not use lists or tables. "
    "If a question is unclear, ask one short question back instead of answering."
)
# name -> (spec, keys)
TENANTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "alpha": ({"models": [MODEL], "priorityClass": "standard"}, ["sk-alpha-0"]),
    "beta": ({"models": ["sm*"], "priorityClass": "standard"}, ["sk-beta-0"]),
    "ops": ({"models": ["*"], "priorityClass": "critical"}, ["sk-ops-0"]),
    "batch": ({"models": [MODEL], "priorityClass": "best-effort"}, ["sk-batch-0"]),
    "metered": (
        {"models": [MODEL], "quota": {"tokensPerMinute": 900}},
        ["sk-metered-0"],
    ),
    "counted": ({"models": [MODEL], "quota": {"requestsPerMinute": 5}}, ["sk-counted-0"]),
    "nothing": ({"models": []}, ["sk-nothing-0"]),
    "strict": (
        {"models": [MODEL], "quota": {"requestsPerMinute": 1000}, "onStoreFailure": "closed"},
        ["sk-strict-0"],
    ),
}


def manifests(tenants: dict[str, tuple[dict[str, Any], list[str]]]) -> str:
    documents: list[dict[str, Any]] = []
    for name, (spec, keys) in tenants.items():
        documents.append(
            {
                "apiVersion": "kvpilot.dev/v1alpha1",
                "kind": "Tenant",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"apiKeys": [{"name": f"{name}-keys"}], **spec},
            }
        )
        data = {f"k{i}": base64.b64encode(k.encode()).decode() for i, k in enumerate(keys)}
        documents.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{name}-keys", "namespace": NS},
                "data": data,
            }
        )
    return yaml.safe_dump_all(documents)


@dataclass
class Platform:
    engine: ServeProcess
    routers: list[ServeProcess]
    redis: RedisServer
    tenants_file: Path

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.routers]


def start_router_process(*args: str) -> ServeProcess:
    cmd = [sys.executable, "-m", "kvpilot.cli", "router", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    router = ServeProcess(proc)
    threading.Thread(target=router.read_log, daemon=True).start()
    return router


def wait_ready(process: ServeProcess, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:
        while True:
            assert process.proc.poll() is None, "".join(process.log)
            assert time.monotonic() < deadline, "not ready:\n" + "".join(process.log[-30:])
            if process.port is not None:
                try:
                    if client.get(f"{process.url}/ready").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.1)


def wait_tokenizer(router: ServeProcess, timeout: float = 60) -> None:
    """Shared prefixes are found by their tokens: wait for the router's tokenizer."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": "Bearer sk-ops-0"}
    with httpx.Client(timeout=5) as client:
        while not client.get(f"{router.url}/v1/models/{MODEL}", headers=headers).json()["kvpilot"][
            "tokenizerLoaded"
        ]:
            assert time.monotonic() < deadline, "the router did not load the tokenizer"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    folder = tmp_path_factory.mktemp("tenancy")
    redis = RedisServer(folder)
    redis.start()
    tenants_file = folder / "tenants.yaml"
    tenants_file.write_text(manifests(TENANTS))
    shared = folder / "shared.txt"
    shared.write_text(SHARED_SYSTEM)
    engine = start_serve(MODEL, "--scheduling-policy", "priority")
    routers: list[ServeProcess] = []
    try:
        wait_ready(engine)
        args = [
            "--static", f"{MODEL}={engine.url}",
            "--static", f"{HIDDEN}={engine.url}",
            "--static-shared-prefix", f"{MODEL}={shared}",
            "--tenants-file", str(tenants_file),
            "--quota-store-url", redis.url,
            "--replica-concurrency", "2",
        ]  # fmt: skip
        routers.extend(start_router_process(*args) for _ in range(2))
        for router in routers:
            wait_ready(router)
            wait_tokenizer(router)
        yield Platform(engine, routers, redis, tenants_file)
    finally:
        for router in routers:
            stop(router.proc)
        stop(engine.proc)
        redis.stop()


def chat_body(content: str, *, max_tokens: int = 4, model: str = MODEL, **extra: Any) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


async def post(
    http: httpx.AsyncClient, url: str, key: str | None, body: dict[str, Any]
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)


async def test_keys_grants_and_rate_limit_headers(platform: Platform) -> None:
    url = platform.urls[0]
    async with httpx.AsyncClient(timeout=60) as http:
        missing = await post(http, url, None, chat_body("hi"))
        wrong = await post(http, url, "sk-alpha-9", chat_body("hi"))
        assert missing.status_code == wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert "sk-alpha-9" not in wrong.text
        hidden = await post(http, url, "sk-alpha-0", chat_body("hi", model=HIDDEN))
        absent = await post(http, url, "sk-alpha-0", chat_body("hi", model="no-such-model"))
        assert hidden.status_code == absent.status_code == 403
        assert hidden.json()["error"]["message"].replace(HIDDEN, "X") == absent.json()["error"][
            "message"
        ].replace("no-such-model", "X")
        # A tenant granted everything learns that a model does not exist.
        ops_absent = await post(http, url, "sk-ops-0", chat_body("hi", model="no-such-model"))
        assert ops_absent.status_code == 404
        assert (await post(http, url, "sk-ops-0", chat_body("hi"))).status_code == 200
        metered = await post(http, url, "sk-metered-0", chat_body("hi"))
        assert metered.status_code == 200
        assert metered.headers["x-kvpilot-tenant"] == f"{NS}/metered"
        assert int(metered.headers["x-ratelimit-limit-tokens"]) == 900
        remaining = int(metered.headers["x-ratelimit-remaining-tokens"])
        assert 0 <= remaining < 900
        assert metered.headers["x-ratelimit-reset-tokens"].endswith("s")
    # The openai client, as tenants use it.
    client = openai.AsyncOpenAI(base_url=f"{platform.urls[1]}/v1", api_key="sk-beta-0")
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
    )
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, stream=True
    )
    chunks = [chunk async for chunk in stream]
    # The usage chunk the router asked for is not passed to a client that did not.
    assert chunks and all(chunk.choices for chunk in chunks)
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"{platform.urls[1]}/v1", api_key="x").models.list()


async def test_a_rotated_key_works_and_the_old_one_stops_within_seconds(
    platform: Platform,
) -> None:
    rotated = {**TENANTS, "alpha": (TENANTS["alpha"][0], ["sk-alpha-1"])}
    async with httpx.AsyncClient(timeout=60) as http:
        for url in platform.urls:
            assert (await post(http, url, "sk-alpha-0", chat_body("hi"))).status_code == 200
        platform.tenants_file.write_text(manifests(rotated))
        started = time.monotonic()
        try:
            for url in platform.urls:
                while (await post(http, url, "sk-alpha-1", chat_body("hi"))).status_code != 200:
                    assert time.monotonic() - started < 5, "the new key did not work in 5 s"
                    await asyncio.sleep(0.05)
                assert (await post(http, url, "sk-alpha-0", chat_body("hi"))).status_code == 401
        finally:
            platform.tenants_file.write_text(manifests(TENANTS))
        for url in platform.urls:
            while (await post(http, url, "sk-alpha-0", chat_body("hi"))).status_code != 200:
                assert time.monotonic() - started < 10
                await asyncio.sleep(0.05)


async def test_quotas_hold_across_two_routers(platform: Platform) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        # Requests per minute: exactly 5 admitted of 12 sent at once through both routers
        # (unless the minute turns over meanwhile: then the new window admits up to 5 more).
        window = int(time.time() // 60)
        answers = await asyncio.gather(
            *(
                post(http, platform.urls[i % 2], "sk-counted-0", chat_body(f"count {i}"))
                for i in range(12)
            )
        )
        admitted = sum(a.status_code == 200 for a in answers)
        refused = [a for a in answers if a.status_code == 429]
        assert admitted + len(refused) == 12
        assert admitted == 5 or int(time.time() // 60) != window
        assert refused and all(int(a.headers["Retry-After"]) >= 1 for a in refused)
        assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
        assert refused[0].headers["x-ratelimit-remaining-requests"] == "0"

        # Tokens per minute (900): streams of 24 tokens through both routers, 4 at a time.
        served = 0
        window = int(time.time() // 60)

        async def one(i: int) -> int:
            body = chat_body(f"Write a long story number {i}", max_tokens=24, stream=True)
            body["stream_options"] = {"include_usage": True}
            headers = {"Authorization": "Bearer sk-metered-0"}
            url = platform.urls[i % 2]
            async with http.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    assert response.status_code == 429
                    return -1
                total = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            total = usage["total_tokens"]
                return total

        refusals = 0
        # Three at a time: at most 3 x 24 completion tokens are in flight past the budget.
        for start in range(0, 63, 3):
            results = await asyncio.gather(*(one(start + i) for i in range(3)))
            served += sum(r for r in results if r > 0)
            refusals += sum(r < 0 for r in results)
            if refusals >= 3:
                break
        if int(time.time() // 60) == window:
            assert refusals >= 3, "the token quota never refused"
            # The metered tenant's earlier request in the header test may share this window.
            assert served <= 900 * 1.10, f"{served} tokens served on a 900-token budget"
            assert served >= 900 * 0.5


async def test_prefix_cache_is_salted_per_tenant_but_the_shared_prefix(platform: Platform) -> None:
    url = platform.urls[0]
    private = " ".join(random.Random(7).choices(string.ascii_lowercase, k=120))
    async with httpx.AsyncClient(timeout=60) as http:

        async def cached(key: str, messages: list[dict[str, str]]) -> int:
            """The engine's cached prompt tokens; the router's prediction (its prefix index,
            hashed with the same salt) must be what the engine then holds."""
            await asyncio.sleep(0.3)  # the last request's block events reach the router
            body = {"model": MODEL, "messages": messages, "max_tokens": 1}
            answer = await post(http, url, key, body)
            assert answer.status_code == 200, answer.text
            hit = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            route = answer.headers["x-kvpilot-route"]
            predicted = int(route.split("prefix-tokens=")[1].split(";")[0])
            assert predicted <= hit and (predicted > 0) == (hit > 0), (route, hit)
            return hit

        # Its own system message: nothing of the template's default one is cached already.
        question = [{"role": "system", "content": private}, {"role": "user", "content": "Hi"}]
        assert await cached("sk-alpha-0", question) == 0
        assert await cached("sk-alpha-0", question) > 0  # the tenant's own blocks
        assert await cached("sk-beta-0", question) == 0  # never another tenant's

        def with_system(text: str) -> list[dict[str, str]]:
            return [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": text}]

        await cached("sk-alpha-0", with_system("What is a tenant?"))
        shared_hit = await cached("sk-beta-0", with_system("And what is a router?"))
        # Beta reuses the shared system prompt's full blocks that alpha computed, nothing more.
        assert shared_hit > 0
        own_hit = await cached("sk-beta-0", with_system("And what is a router?"))
        assert own_hit > shared_hit


async def test_a_critical_request_overtakes_a_best_effort_queue(platform: Platform) -> None:
    url = platform.urls[1]
    first_token: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=120) as http:

        async def stream(name: str, key: str, max_tokens: int) -> None:
            body = chat_body(f"Tell a long tale about {name}", max_tokens=max_tokens, stream=True)
            body["ignore_eos"] = True
            headers = {"Authorization": f"Bearer {key}"}
            async with http.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers
            ) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and name not in first_token:
                        first_token[name] = time.monotonic()

        batch = [asyncio.create_task(stream(f"batch{i}", "sk-batch-0", 48)) for i in range(6)]
        # Two run (the router's replica concurrency), four wait in the fair queue.
        while len(first_token) < 2:
            await asyncio.sleep(0.01)
        # The queue is visible: per tenant, and to the operator's autoscaler as held requests.
        metrics = (await http.get(f"{url}/metrics")).text
        assert sample(metrics, "kvpilot_router_tenant_queued", tenant=f"{NS}/batch") == 4
        assert sample(metrics, "kvpilot_router_held_requests", model=MODEL) == 4
        await stream("ops", "sk-ops-0", 4)
        await asyncio.gather(*batch)
    later = sorted(first_token[f"batch{i}"] for i in range(6))
    assert first_token["ops"] < later[2], "the critical request waited behind the batch queue"


def sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for item in family.samples:
            if item.name == name and all(item.labels.get(k) == v for k, v in labels.items()):
                return item.value
    return None


async def test_a_thousand_generated_requests_no_5xx_and_nothing_ungranted(
    platform: Platform,
) -> None:
    rng = random.Random(41)
    keys = {key: name for name, (_, ks) in TENANTS.items() for key in ks}
    models = [MODEL, HIDDEN, "no-such-model", "SMOL", "smol ", "", "x" * 300, "sm", "../smol"]
    statuses: dict[int, int] = {}
    served_to: list[tuple[str, str]] = []

    def random_request() -> tuple[dict[str, str], bytes]:
        headers: dict[str, str] = {"content-type": "application/json"}
        choice = rng.random()
        key = rng.choice(list(keys))
        if choice < 0.55:
            headers["authorization"] = f"Bearer {key}"
        elif choice < 0.65:
            headers["authorization"] = f"bearer {key}"
        elif choice < 0.75:
            headers["authorization"] = "Bearer " + "".join(rng.choices(string.printable[:94], k=20))
        elif choice < 0.8:
            headers["authorization"] = f"Basic {key}"
        elif choice < 0.85:
            headers["authorization"] = "Bearer"
        if rng.random() < 0.3:
            headers[f"x-{rng.choice(['tenant', 'kvpilot-tenant', 'priority'])}"] = "ops"
        model = MODEL if rng.random() < 0.5 else rng.choice(models)
        # A one-token prompt and answer: the engine's part stays small; the router's is the test.
        body: dict[str, Any] = {"model": model, "prompt": "hi", "max_tokens": 1}
        if rng.random() < 0.2:
            body["priority"] = rng.choice([-100, 0, 5, "high"])
        if rng.random() < 0.2:
            body["cache_salt"] = rng.choice(["", "tenant:teams/ops", "x"])
        if rng.random() < 0.1:
            body["stream"] = True
        raw = json.dumps(body).encode()
        if rng.random() < 0.05:
            raw = raw[: rng.randrange(len(raw))]
        return headers, raw

    async with httpx.AsyncClient(timeout=120) as http:
        semaphore = asyncio.Semaphore(16)

        async def send(i: int) -> None:
            headers, raw = random_request()
            async with semaphore:
                url = platform.urls[i % 2]
                answer = await http.post(f"{url}/v1/completions", content=raw, headers=headers)
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
            assert answer.status_code < 500, (answer.status_code, answer.text)
            if answer.status_code == 200:
                tenant = answer.headers["x-kvpilot-tenant"].split("/")[1]
                model = json.loads(raw)["model"]
                presented = headers.get("authorization", "")[len("Bearer ") :]
                assert keys.get(presented) == tenant, "served to a tenant whose key was not sent"
                assert is_granted(model, TENANTS[tenant][0]["models"]), (tenant, model)
                served_to.append((tenant, model))

        await asyncio.gather(*(send(i) for i in range(1000)))
    assert sum(statuses.values()) == 1000
    assert statuses.get(200, 0) > 100 and statuses.get(401, 0) > 100 and statuses.get(403, 0) > 20
    assert {tenant for tenant, _ in served_to} >= {"alpha", "beta", "ops"}


async def test_a_store_that_goes_away_fails_each_tenant_open_or_closed(platform: Platform) -> None:
    """Last in the module: it stops the shared Redis (and starts it again)."""
    url = platform.urls[0]
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await post(http, url, "sk-strict-0", chat_body("hi"))).status_code == 200
        platform.redis.stop()
        try:
            closed = await post(http, url, "sk-strict-0", chat_body("hi"))
            assert closed.status_code == 503, closed.text
            assert closed.json()["error"]["code"] == "quota_store_unavailable"
            assert int(closed.headers["Retry-After"]) >= 1
            # `counted` fails open: this router's own count holds its 5 a minute meanwhile.
            opened = await post(http, url, "sk-counted-0", chat_body("hi"))
            assert opened.status_code in (200, 429), opened.text
            metrics = (await http.get(f"{url}/metrics")).text
            assert sample(metrics, "kvpilot_router_quota_store_up") == 0
        finally:
            platform.redis.start()

        async def back() -> bool:
            return (await post(http, url, "sk-strict-0", chat_body("hi"))).status_code == 200

        deadline = time.monotonic() + 15
        while not await back():
            assert time.monotonic() < deadline, "the store came back but the tenant stays refused"
            await asyncio.sleep(0.2)
