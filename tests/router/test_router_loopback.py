"""`kvpilot router` in front of three real `kvpilot serve` replicas of the bundled SmolLM2 (small
KV pools, so eviction happens), discovering them through kmock's Kubernetes API emulator:

- requests sharing a prefix go to the replica holding it, and the engine confirms the hit;
- after that replica evicts the blocks, the router prefers the one that still holds them;
- the router's index equals each engine's own cache, and a restarted router rebuilds it exactly;
- streams pass through token by token (the first token arrives while the engine still runs);
- a replica that dies is skipped (its Pod still says Ready);
- an unknown model is a 404 with an OpenAI error body;
- a model at zero replicas: requests are held, the InferenceService is annotated for the operator
  within 2 s, and they are served once a replica is Ready; a hold that times out is a 503;
- held requests go as soon as the replica is routable, not after the router fetched and loaded
  its tokenizer (routed by load meanwhile), and a model woken again keeps the tokenizer;
- LoRA adapters (made by PEFT, one slot per engine): a request naming one goes to a free slot,
  then to the replica where it is resident, whose engine confirms the prefix hit the router
  predicted with the adapter's hashes; another adapter takes another replica's free slot
  instead of evicting the first.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path
from kvpilot.router.kube import WAKE_ANNOTATION
from kvpilot.router.scoring import rendezvous

from ..engine.lora_reference import make_peft_adapter
from ..operator.conftest import NAMESPACE, PODS_PATH
from ..operator.emulated import api
from ..operator.kube_emulator import KubeEmulator
from ..server.serve_process import ServeProcess
from .loopback import (
    SECRETS_PATH,
    RouterProcess,
    create_isvc,
    create_pod,
    engine_digest,
    eventually_async,
    isvc_annotations,
    key_secret,
    router_index,
    start_router,
    start_serve,
    stop,
    tokenizer_gate,
    wait_ready,
)

pytestmark = [pytest.mark.slow, pytest.mark.kmock(cls=KubeEmulator), pytest.mark.timeout(300)]

MODEL = "smollm"
SLEEPY_SECRET = "sleepy-engine-key"
SLEEPY_KEY = "sk-sleepy-0123456789"
ADAPTERS = ("team-a", "team-b")
PODS = ("engine-a", "engine-b", "engine-c")
TENANT = (
    "You are the support assistant of Tenant One, a company that rents bicycles in Lisbon. "
    "Always answer politely, in short sentences, and never invent prices. Opening hours are "
    "nine to six on weekdays and ten to four on weekends. Helmets are free with every rental. "
    "Electric bicycles need a deposit. Children under twelve ride only with an adult. "
    "Routes along the river are flat; routes to the castle are steep. Refer complaints to the "
    "manager by email. Do not discuss other companies."
)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One PEFT adapter under each name: routing does not look at the weights, and making one
    takes seconds."""
    root = tmp_path_factory.mktemp("router-adapters")
    first = make_peft_adapter(
        gguf_to_hf_dir(bundled_gguf_path()), root / ADAPTERS[0], rank=8, seed=0, scale=0.5
    )
    for name in ADAPTERS[1:]:
        shutil.copytree(first, root / name)
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def replicas(adapters: dict[str, Path]) -> Iterator[dict[str, ServeProcess]]:
    # One slot each: a second adapter on a replica evicts the first.
    lora = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--lora-modules"]
    lora += [f"{name}={path}" for name, path in adapters.items()]
    started = {pod: start_serve(MODEL, *lora) for pod in PODS}
    try:
        asyncio.run(asyncio.wait_for(_all_ready(list(started.values())), 300))
        yield started
    finally:
        for served in started.values():
            stop(served.proc)


async def _all_ready(served: list[ServeProcess]) -> None:
    await asyncio.gather(*(wait_ready(s) for s in served))


@pytest.fixture()
async def router(
    kmock: KubeEmulator,
    kubeconfig: Path,
    replicas: dict[str, ServeProcess],
    adapters: dict[str, Path],
) -> AsyncIterator[RouterProcess]:
    await create_isvc(kmock, MODEL, MODEL, adapters=adapters)
    for pod, served in replicas.items():
        if served.proc.poll() is None:
            assert served.port is not None
            await create_pod(kmock, pod, MODEL, served.port)
    running = await start_router(kubeconfig)
    await wait_routable(running, {p for p, s in replicas.items() if s.proc.poll() is None})
    yield running
    stop(running.proc)


async def wait_routable(router: RouterProcess, pods: set[str]) -> None:
    """Every pod routable, and the tokenizer loaded (until then requests go by load alone)."""

    async def check() -> bool:
        replicas = (await router_index(router)).get(MODEL, {})
        return {name for name, r in replicas.items() if r["routable"]} == pods

    async def tokenizer_loaded() -> bool:
        async with httpx.AsyncClient(timeout=10) as http:
            card = (await http.get(f"{router.url}/v1/models/{MODEL}")).json()
        return bool(card["kvpilot"]["tokenizerLoaded"])

    await eventually_async(check, timeout=30)
    await eventually_async(tokenizer_loaded, timeout=30)


def client(router: RouterProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


async def ask(
    router: RouterProcess, question: str, model: str = MODEL, **extra: object
) -> tuple[str, str, int]:
    """(replica, route header, cached prompt tokens the engine reports) for one chat turn."""
    raw = await client(router).chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": TENANT}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        **extra,
    )
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    cached = completion.usage.prompt_tokens_details.cached_tokens or 0
    return raw.headers["x-kvpilot-replica"], raw.headers["x-kvpilot-route"], cached


async def fill_cache(url: str, seed: int) -> None:
    """Prompts of unrelated tokens sent straight to one engine: they push out its older blocks."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(2):
            prompt = [rng.randrange(1000, 40000) for _ in range(600)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200


async def index_matches_engines(router: RouterProcess, replicas: dict[str, ServeProcess]) -> bool:
    index = (await router_index(router))[MODEL]
    for pod, served in replicas.items():
        if pod in index and index[pod]["digest"] != await engine_digest(served.url):
            return False
    return True


async def test_prefix_routing_eviction_restart_and_streaming(
    kmock: KubeEmulator,
    kubeconfig: Path,
    router: RouterProcess,
    replicas: dict[str, ServeProcess],
) -> None:
    models = await client(router).models.list()
    assert [m.id for m in models.data] == [MODEL, *ADAPTERS]
    with pytest.raises(openai.NotFoundError) as missing:
        await client(router).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]

    # A shared prefix: the first turn lands somewhere, every later one on that replica, and the
    # engine there confirms it served the system prompt from its cache.
    holder, _, _ = await ask(router, "Do you rent tandems?")
    await eventually_async(lambda: index_matches_engines(router, replicas))
    for question in ("Is there parking?", "Can I pay by card?", "Are dogs allowed?"):
        replica, route, cached = await ask(router, question)
        assert (replica, route.split(";")[0]) == (holder, "prefix"), route
        assert int(route.split("prefix-tokens=")[1]) >= 96 and cached >= 96

    # Another replica gets the prefix too (sent to it directly), then the holder evicts it: the
    # router now prefers the one that still has it.
    other = next(p for p in PODS if p != holder)
    await ask_direct(replicas[other].url, "Do you rent tandems?")
    await fill_cache(replicas[holder].url, seed=1)
    await eventually_async(lambda: index_matches_engines(router, replicas))
    replica, route, cached = await ask(router, "What about helmets?")
    assert (replica, route.split(";")[0]) == (other, "prefix"), route
    assert cached >= 96

    # Every decision is counted by reason, and what the chosen replica held is recorded.
    async with httpx.AsyncClient(timeout=10) as http:
        metrics = (await http.get(f"{router.url}/metrics")).text
    assert metric(metrics, 'kvpilot_router_decisions_total{model="smollm",reason="prefix"}') >= 4
    assert metric(metrics, 'kvpilot_router_prefix_match_tokens_count{model="smollm"}') >= 5
    assert metric(metrics, 'kvpilot_router_replicas{model="smollm",state="routable"}') == 3

    # A restarted router rebuilds exactly the index the first one had (the engines' caches).
    before = await router_index(router)
    stop(router.proc)
    restarted = await start_router(kubeconfig)
    try:
        await wait_routable(restarted, set(PODS))
        after = await router_index(restarted)
        assert {p: r["digest"] for p, r in after[MODEL].items()} == {
            p: r["digest"] for p, r in before[MODEL].items()
        }
        assert await index_matches_engines(restarted, replicas)
        await check_streaming(restarted, replicas)
    finally:
        stop(restarted.proc)


async def test_adapters_go_to_a_free_slot_then_where_they_are_resident(
    router: RouterProcess, replicas: dict[str, ServeProcess]
) -> None:
    async def resident() -> dict[str, list[str]]:
        index = (await router_index(router))[MODEL]
        return {pod: r["resident_loras"] for pod, r in index.items()}

    async def slots_known() -> bool:
        index = (await router_index(router))[MODEL]
        return all(r["max_loras"] == 1 for r in index.values())

    # An engine reports its slots from its first step on.
    for served in replicas.values():
        await ask_direct(served.url, "Hello?")
    await eventually_async(slots_known)
    before = await resident()
    question = "Which bicycle suits a child?"
    # Resident nowhere yet (or where an earlier test left it): a free slot or its replica.
    first, route, _ = await ask(router, question, "team-a")
    assert route.endswith("adapter=free") or route.endswith("adapter=resident"), route
    assert (route.endswith("adapter=resident")) == ("team-a" in before[first])

    async def team_a_resident() -> bool:
        return "team-a" in (await resident())[first]

    await eventually_async(team_a_resident)
    # Now resident there, and its blocks hashed with the adapter are there too: the engine
    # reports the prefix the router predicted as cached.
    replica, route, cached = await ask(router, question, "team-a")
    assert (replica, route.split(";")[0], route.split("; ")[2]) == (
        first, "prefix", "adapter=resident",
    ), route  # fmt: skip
    predicted = int(route.split("prefix-tokens=")[1].split(";")[0])
    assert predicted >= 96 and cached >= predicted

    # Another adapter: a replica whose one slot is free, not an eviction of team-a.
    others = [p for p, held in (await resident()).items() if not held]
    assert others, await resident()
    replica, route, _ = await ask(router, question, "team-b")
    assert replica in others and route.endswith("adapter=free"), (replica, route)
    async with httpx.AsyncClient(timeout=10) as http:
        cards = {m["id"]: m for m in (await http.get(f"{router.url}/v1/models")).json()["data"]}
        metrics = (await http.get(f"{router.url}/metrics")).text
    assert {m: cards[m]["parent"] for m in ADAPTERS} == {"team-a": MODEL, "team-b": MODEL}
    labels = 'model="team-a",slot="resident"'
    assert metric(metrics, f"kvpilot_router_adapter_routes_total{{{labels}}}") >= 1


async def ask_direct(url: str, question: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as direct:
        await direct.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": TENANT}, {"role": "user", "content": question}],
            max_tokens=1,
        )


async def check_streaming(router: RouterProcess, replicas: dict[str, ServeProcess]) -> None:
    """Chunks reach the client while the engine is still generating, one per token."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to one hundred."}],
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    running_at_first_token: float | None = None
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", f"{router.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        replica_url = replicas[response.headers["x-kvpilot-replica"]].url
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if (
                running_at_first_token is None
                and '"content":"' in line
                and '"content":""' not in line
            ):
                metrics = (await http.get(f"{replica_url}/metrics")).text
                running_at_first_token = running_requests(metrics)
    assert running_at_first_token == 1.0, "the first token arrived after the engine finished"
    content_events = [e for e in events if '"content":"' in e and '"content":""' not in e]
    assert len(content_events) >= 40  # 48 tokens; a few may be held back for UTF-8 or merged
    assert events[-1] == "data: [DONE]"


def metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {sample} in the router's /metrics")


def running_requests(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("kvpilot:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvpilot:num_requests_running in /metrics")


async def test_a_dead_replica_is_skipped(
    router: RouterProcess, replicas: dict[str, ServeProcess]
) -> None:
    victim = "engine-c"
    # Sessions whose affinity favourite is the victim: while it lives they go there...
    sessions = [
        f"s{i}" for i in range(40) if max(PODS, key=lambda p: rendezvous(f"s{i}", p)) == victim
    ]
    assert len(sessions) >= 4
    replica, route, _ = await ask(router, "Hello?", extra_headers={"x-session-id": sessions[0]})
    assert (replica, route.split(";")[0]) == (victim, "affinity")
    # ...after it dies (its Pod still Ready: no one told Kubernetes), they go elsewhere and work.
    stop(replicas[victim].proc)
    for session in sessions[:4]:
        replica, _, _ = await ask(
            router, f"Hello from {session}?", extra_headers={"x-session-id": session}
        )
        assert replica != victim
    index = (await router_index(router))[MODEL]
    assert index[victim]["routable"] is False


async def test_scale_from_zero_holds_wakes_and_serves_and_a_hold_times_out(
    kmock: KubeEmulator, kubeconfig: Path, replicas: dict[str, ServeProcess], tmp_path: Path
) -> None:
    # The replica that will "wake" starts loading now; the router must hold requests until its
    # Pod is Ready. Its engine requires an API key on every path but the probes: the router
    # reads it from the Secret the InferenceService names, for the block events, the tokenizer
    # and the requests.
    key_file = tmp_path / "engine-key"
    key_file.write_text(SLEEPY_KEY)
    waking = start_serve("sleepy", "--api-key-file", str(key_file))
    try:
        await api(kmock, "POST", SECRETS_PATH, key_secret(SLEEPY_SECRET, SLEEPY_KEY))
        await create_isvc(kmock, "sleepy", "sleepy", min_replicas=0, api_key_secret=SLEEPY_SECRET)
        await create_isvc(
            kmock, "never", "never", min_replicas=0,
            annotations={"kvpilot.dev/hold-timeout-seconds": "1.5"},
        )  # fmt: skip
        router = await start_router(kubeconfig)
        try:
            async with httpx.AsyncClient(timeout=120) as http:
                # A hold that runs out: 503 with Retry-After, and the operator was asked.
                started = time.monotonic()
                timed_out = await http.post(
                    f"{router.url}/v1/completions",
                    json={"model": "never", "prompt": "hi", "max_tokens": 1},
                )
                assert timed_out.status_code == 503, timed_out.text
                assert time.monotonic() - started >= 1.4
                assert timed_out.headers["retry-after"] == "30"
                assert timed_out.json()["error"]["code"] == "no_replica"
                assert WAKE_ANNOTATION in isvc_annotations(kmock, "never")

                held = [
                    asyncio.create_task(
                        http.post(
                            f"{router.url}/v1/completions",
                            json={"model": "sleepy", "prompt": f"Request {i}", "max_tokens": 2},
                        )
                    )
                    for i in range(3)
                ]
                first_held = time.monotonic()
                await eventually_async(
                    lambda: asyncio.sleep(0, WAKE_ANNOTATION in isvc_annotations(kmock, "sleepy")),
                    timeout=2.0,
                    interval=0.02,
                )
                assert time.monotonic() - first_held < 2.0
                metrics = (await http.get(f"{router.url}/metrics")).text
                held_sample = (
                    "kvpilot_router_held_requests"
                    f'{{inferenceservice="sleepy",model="sleepy",namespace="{NAMESPACE}"}}'
                )
                assert metric(metrics, held_sample) == 3.0
                assert not any(task.done() for task in held)

                await wait_ready(waking)
                assert waking.port is not None
                refused = await http.get(f"{waking.url}/v1/models")
                assert refused.status_code == 401  # the engine does require its key
                await create_pod(kmock, "sleepy-0", "sleepy", waking.port)
                responses = await asyncio.wait_for(asyncio.gather(*held), 60)
                assert [r.status_code for r in responses] == [200, 200, 200]
                assert {r.headers["x-kvpilot-replica"] for r in responses} == {"sleepy-0"}
                metrics = (await http.get(f"{router.url}/metrics")).text
                assert 'kvpilot_router_hold_seconds_count{model="sleepy"} 3.0' in metrics
                assert metric(metrics, held_sample) == 0.0
                assert "kvpilot_router_engine_unauthorized_total{" not in metrics

                # Its block events reached the router: the blocks a long prompt left in the
                # engine's cache are in the router's index, and its tokenizer files came too.
                long = {"model": "sleepy", "prompt": TENANT, "max_tokens": 1}
                answer = await http.post(f"{router.url}/v1/completions", json=long)
                assert answer.status_code == 200, answer.text

                async def indexed() -> bool:
                    index = (await router_index(router)).get("sleepy", {})
                    replica = index.get("sleepy-0") or {}
                    return replica.get("num_blocks", 0) > 0 and replica.get(
                        "digest"
                    ) == await engine_digest(waking.url, SLEEPY_KEY)

                await eventually_async(indexed, timeout=10)

                async def tokenizer_loaded() -> bool:
                    card = (await http.get(f"{router.url}/v1/models/sleepy")).json()
                    return bool(card["kvpilot"]["tokenizerLoaded"])

                await eventually_async(tokenizer_loaded, timeout=30)
        finally:
            stop(router.proc)
    finally:
        stop(waking.proc)


async def held_count(http: httpx.AsyncClient, router: RouterProcess, isvc: str) -> float:
    text = (await http.get(f"{router.url}/metrics")).text
    sample = (
        "kvpilot_router_held_requests"
        f'{{inferenceservice="{isvc}",model="{MODEL}",namespace="{NAMESPACE}"}}'
    )
    return metric(text, sample) if sample in text else 0.0


async def test_a_woken_model_is_served_before_its_tokenizer_loads_and_keeps_it(
    kmock: KubeEmulator, kubeconfig: Path, replicas: dict[str, ServeProcess]
) -> None:
    engine = replicas["engine-a"]
    assert engine.proc.poll() is None
    await create_isvc(kmock, "lazy", MODEL, min_replicas=0)
    router = await start_router(kubeconfig)
    try:
        async with tokenizer_gate(engine.url) as gate, httpx.AsyncClient(timeout=120) as http:

            async def complete(prompt: str) -> httpx.Response:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                return await http.post(f"{router.url}/v1/completions", json=body)

            async def wake(pod: str) -> httpx.Response:
                held = asyncio.create_task(complete(f"{TENANT} Wake up, {pod}."))
                await eventually_async(lambda: held_count(http, router, "lazy"), timeout=10)
                await create_pod(kmock, pod, "lazy", gate.port)
                return await asyncio.wait_for(held, 60)

            # The tokenizer fetch hangs: the held request is served all the same, by load.
            first = await wake("lazy-0")
            assert first.status_code == 200, first.text
            assert first.headers["x-kvpilot-replica"] == "lazy-0"
            assert first.headers["x-kvpilot-route"].startswith("fallback")
            assert gate.tokenizer_requests >= 1 and not gate.opened.is_set()

            # Once it loads, requests are routed by their prefix again.
            gate.opened.set()

            async def tokenized() -> bool:
                response = await complete(f"{TENANT} Are helmets free?")
                return not response.headers["x-kvpilot-route"].startswith("fallback")

            await eventually_async(tokenized, timeout=30, interval=0.2)
            fetched = gate.tokenizer_requests

            # Scaled to zero and woken again: the same tokenizer, not fetched again.
            await api(kmock, "DELETE", f"{PODS_PATH}/lazy-0")

            async def at_zero() -> bool:
                return not (await router_index(router)).get(MODEL)

            await eventually_async(at_zero, timeout=10)
            again = await wake("lazy-1")
            assert again.status_code == 200, again.text
            assert again.headers["x-kvpilot-replica"] == "lazy-1"
            assert not again.headers["x-kvpilot-route"].startswith("fallback")
            assert gate.tokenizer_requests == fetched
    finally:
        stop(router.proc)
