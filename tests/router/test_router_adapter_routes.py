"""Requests naming LoRA adapters through a real router (uvicorn on loopback, its real block-event
followers), in front of two stand-in engines that speak the engine's contract
(kvpilot.contract.kv_events: a snapshot of the block hashes they hold and heartbeats with their
load, resident adapters and slots; an OpenAI completion answer that names the replica). Each
request's replica and reason come back in the router's headers, its decision in /metrics; the
adapters are listed in /v1/models with their parent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract.block_hash import chain_block_hashes
from kvpilot.contract.kv_events import Load
from kvpilot.router.config import RouterConfig

from .stand_in import PROMPT, StandIn, serve_router, serve_stand_in

BLOCK_SIZE = 4
# The static model's pods, by the order of its URLs: the stand-ins a and b.
STAND_INS = {"base-0": "a", "base-1": "b"}


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[str, StandIn, StandIn]]:
    """Replica a holds the prompt's blocks under adapter `sql`, which is resident there (one of
    2 slots taken); b holds the base model's, and both its slots are taken."""
    a = StandIn(
        "a",
        chain_block_hashes(PROMPT[:-1], BLOCK_SIZE, None, lora_name="sql"),
        Load(resident_loras=["sql"], max_loras=2),
    )
    b = StandIn(
        "b",
        chain_block_hashes(PROMPT[:-1], BLOCK_SIZE, None),
        Load(resident_loras=["chat", "other"], max_loras=2),
    )
    async with serve_stand_in(a) as a_url, serve_stand_in(b) as b_url:
        config = RouterConfig(
            namespaces=(),
            static_models=(("base", (a_url, b_url)),),
            static_adapters=(("base", ("sql", "chat", "fresh")),),
        )
        async with serve_router(config) as router_url, httpx.AsyncClient(timeout=10) as http:
            for _ in range(200):  # both streams followed
                index = (await http.get(f"{router_url}/kvpilot/v1/router/index")).json()
                if (
                    all(r["routable"] for r in index.get("base", {}).values())
                    and len(index.get("base", {})) == 2
                ):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"replicas not routable: {index}")
            yield router_url, a, b


async def complete(http: httpx.AsyncClient, url: str, model: str) -> httpx.Response:
    return await http.post(
        f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1}
    )


async def test_adapter_requests_go_where_the_adapter_is_resident_then_to_a_free_slot(
    cluster: tuple[str, StandIn, StandIn],
) -> None:
    url, a, b = cluster
    expected = {
        # Its blocks, hashed with the adapter, are a's; so is the adapter.
        "sql": ("base-0", "prefix; prefix-tokens=40; adapter=resident"),
        # The base model's blocks are b's, and a's `sql` blocks are no use to it.
        "base": ("base-1", "prefix; prefix-tokens=40"),
        # Resident on b, whose base-model blocks are no use to it; a has a free slot.
        "chat": ("base-1", "adapter; prefix-tokens=0; adapter=resident"),
        # Resident nowhere: a's free slot, not an eviction on b.
        "fresh": ("base-0", "load; prefix-tokens=0; adapter=free"),
    }
    async with httpx.AsyncClient(timeout=10) as http:
        for model, (replica, route) in expected.items():
            response = await complete(http, url, model)
            assert response.status_code == 200, response.text
            assert (response.headers["x-kvpilot-replica"], response.headers["x-kvpilot-route"]) == (
                replica,
                route,
            ), model
            assert response.json()["choices"][0]["text"] == STAND_INS[replica]
        # The body went on as the client sent it: the engine sees the adapter's name.
        assert [body["model"] for body in a.bodies] == ["sql", "fresh"]
        assert [body["model"] for body in b.bodies] == ["base", "chat"]

        missing = await complete(http, url, "other")  # resident on b, but no service serves it
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"

        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families((await http.get(f"{url}/metrics")).text)
            for s in f.samples
        }

    def sample(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    assert sample("kvpilot_router_adapter_routes_total", model="sql", slot="resident") == 1
    assert sample("kvpilot_router_adapter_routes_total", model="chat", slot="resident") == 1
    assert sample("kvpilot_router_adapter_routes_total", model="fresh", slot="free") == 1
    assert sample("kvpilot_router_decisions_total", model="chat", reason="adapter") == 1
    assert sample("kvpilot_router_decisions_total", model="base", reason="prefix") == 1
    assert not any(name == "kvpilot_router_adapter_routes_total" and ("model", "base") in labels
                   for name, labels in samples)  # fmt: skip


async def test_models_lists_adapters_with_their_parent(
    cluster: tuple[str, StandIn, StandIn],
) -> None:
    url, _, _ = cluster
    async with httpx.AsyncClient(timeout=10) as http:
        listed = (await http.get(f"{url}/v1/models")).json()
        one = await http.get(f"{url}/v1/models/sql")
        index = (await http.get(f"{url}/kvpilot/v1/router/index")).json()
    cards = {card["id"]: card for card in listed["data"]}
    assert list(cards) == ["base", "chat", "fresh", "sql"]
    assert {m: (c["parent"], c["root"]) for m, c in cards.items()} == {
        "base": (None, "base"),
        "chat": ("base", "chat"),  # static adapters have no URI of their own
        "fresh": ("base", "fresh"),
        "sql": ("base", "sql"),
    }
    assert {m: c["kvpilot"].get("residentReplicas") for m, c in cards.items()} == {
        "base": None, "chat": 1, "fresh": 0, "sql": 1,
    }  # fmt: skip
    assert all(c["kvpilot"]["replicas"] == 2 for c in cards.values())
    assert one.status_code == 200 and one.json() == cards["sql"]
    assert {name: (r["resident_loras"], r["max_loras"]) for name, r in index["base"].items()} == {
        "base-0": (["sql"], 2),
        "base-1": (["chat", "other"], 2),
    }
    assert {c["kvpilot"]["inferenceService"] for c in cards.values()} == {"base"}
