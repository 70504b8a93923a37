"""The OpenAI routes the router serves in front of FastAPI (kvpilot.router.openai_routes), in a
real uvicorn on loopback: what is refused before any replica is chosen gets the engine's OpenAI
error bodies, and every other path still reaches the FastAPI app."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import uvicorn

from kvpilot.contract import errors
from kvpilot.router.app import create_app
from kvpilot.router.config import RouterConfig
from kvpilot.router.runtime import RouterRuntime

# A model whose only replica is nowhere: nothing here needs it to answer.
CONFIG = RouterConfig(
    namespaces=(), static_models=(("m", ("http://127.0.0.1:9",)),), max_body_bytes=4096
)


@pytest.fixture
async def router_url() -> AsyncIterator[str]:
    config = uvicorn.Config(
        create_app(RouterRuntime(CONFIG, None)), host="127.0.0.1", port=0, log_level="warning"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_refusals_have_openai_bodies(router_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as invalid:
        await client.completions.create(model="m", prompt="hi", max_tokens=-1)
    assert invalid.value.body["param"] == "max_tokens"  # type: ignore[index]

    async with httpx.AsyncClient(timeout=10) as http:
        not_json = await http.post(f"{router_url}/v1/chat/completions", content=b"{not json")
        assert not_json.status_code == 400
        assert not_json.json()["error"]["type"] == "invalid_request_error"

        too_big = await http.post(f"{router_url}/v1/completions", content=b"x" * 5000)
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "request_too_large"

        wrong_method = await http.get(f"{router_url}/v1/chat/completions")
        assert wrong_method.status_code == 405
        assert wrong_method.headers["allow"] == "POST"
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"

        # Everything else is the FastAPI app's.
        models = (await http.get(f"{router_url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        assert (await http.get(f"{router_url}/health")).json() == {"status": "ok"}
        unknown = await http.post(f"{router_url}/v1/embeddings", json={})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models/nope", None),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("POST", "/v1/completions", {"model": "nope", "prompt": "hi"}),
    ],
)
async def test_an_unknown_model_is_answered_as_the_engine_answers_it(
    router_url: str, method: str, path: str, body: dict[str, object] | None
) -> None:
    engine = errors.model_not_found("nope", "m")
    async with httpx.AsyncClient(timeout=10) as http:
        got = await http.request(method, f"{router_url}{path}", json=body)
    assert got.status_code == engine.status_code == 404
    error = got.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        engine.type,
        engine.code,
        engine.param,
    )
    assert "`nope`" in error["message"]
