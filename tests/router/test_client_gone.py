"""A request whose client went away while it waited (held for a model without a routable
replica) is dropped, not served to no one once the replica comes: a real router on loopback in
front of a stand-in replica whose block-event stream opens only when the test says."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web

from kvpilot.contract.kv_events import Load
from kvpilot.router.config import RouterConfig

from .stand_in import PROMPT, StandIn, serve_router, serve_stand_in


class GatedStandIn(StandIn):
    """Its block-event stream (and so its routability) waits for `opened`."""

    def __init__(self) -> None:
        super().__init__("a", [], Load())
        self.opened = asyncio.Event()

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        await self.opened.wait()
        return await super().kv_events(request)


@pytest.mark.timeout(60)  # a request held for no one would also hold the router's shutdown
async def test_a_held_request_whose_client_left_is_not_forwarded() -> None:
    engine = GatedStandIn()
    async with serve_stand_in(engine) as engine_url:
        config = RouterConfig(namespaces=(), static_models=(("base", (engine_url,)),))
        async with serve_router(config) as url, httpx.AsyncClient() as http:
            body = {"model": "base", "prompt": PROMPT, "max_tokens": 1}

            async def metric_held() -> float:
                text = (await http.get(f"{url}/metrics")).text
                lines = [
                    x for x in text.splitlines() if x.startswith("kvpilot_router_held_requests{")
                ]
                return sum(float(x.rsplit(" ", 1)[1]) for x in lines)

            client = asyncio.create_task(http.post(f"{url}/v1/completions", json=body, timeout=30))
            while await metric_held() < 1:
                await asyncio.sleep(0.02)
            client.cancel()  # the client goes away while its request is held
            deadline = asyncio.get_running_loop().time() + 5
            while await metric_held() > 0:
                assert asyncio.get_running_loop().time() < deadline, "still held for no one"
                await asyncio.sleep(0.02)
            engine.opened.set()
            # A later request is served: the replica is routable; the one that left never came.
            answer = await http.post(f"{url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 200
            assert len(engine.bodies) == 1
