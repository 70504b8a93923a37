"""A replica that serves no tokenizer: the router routes by load and asks it again only after
its retry interval, not on every request (a real router on loopback, a stand-in replica)."""

from __future__ import annotations

import httpx

from kvpilot.contract.kv_events import TOKENIZER_FILES, Load
from kvpilot.router.config import RouterConfig

from .stand_in import PROMPT, StandIn, serve_router, serve_stand_in


async def test_a_replica_without_a_tokenizer_is_not_asked_on_every_request() -> None:
    engine = StandIn("a", [], Load())
    async with serve_stand_in(engine) as engine_url:
        config = RouterConfig(namespaces=(), static_models=(("base", (engine_url,)),))
        async with serve_router(config) as url, httpx.AsyncClient(timeout=30) as http:
            body = {"model": "base", "prompt": PROMPT, "max_tokens": 1}
            for _ in range(20):
                assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200
            card = (await http.get(f"{url}/v1/models/base")).json()
    assert len(engine.bodies) == 20
    assert not card["kvpilot"]["tokenizerLoaded"]
    # One attempt (each file once), within the retry interval of the first.
    assert engine.tokenizer_requests == len(TOKENIZER_FILES)
