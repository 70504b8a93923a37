"""The router answers an unknown model as the engine and OpenAI do: 404, invalid_request_error,
code model_not_found."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn

from kvpilot.contract import errors
from kvpilot.router.app import create_app
from kvpilot.router.config import RouterConfig
from kvpilot.router.runtime import RouterRuntime

CONFIG = RouterConfig(namespaces=(), static_models=(("m", ("http://127.0.0.1:9",)),))


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
