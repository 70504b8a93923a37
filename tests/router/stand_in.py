"""Stand-in engine replicas for router tests: they speak the engine's contract
(kvpilot.contract.kv_events: a snapshot of the block hashes they hold and heartbeats with their
load; an OpenAI completion answer that names the replica and counts usage), and a real router
(uvicorn on loopback) in front of them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import uvicorn
from aiohttp import web

from kvpilot.contract.block_hash import HASH_SCHEME
from kvpilot.contract.kv_events import (
    KV_EVENTS_PATH,
    TOKENIZER_FILE_PATH,
    KvHeartbeat,
    KvSnapshot,
    Load,
)
from kvpilot.router.app import create_app
from kvpilot.router.config import RouterConfig
from kvpilot.router.kube import KubeAccess
from kvpilot.router.runtime import RouterRuntime

BLOCK_SIZE = 4
PROMPT = list(range(200, 241))  # 41 tokens: 10 full blocks before the last token


@dataclass
class StandIn:
    """An engine replica as the router sees it: its cached hashes and its load."""

    name: str
    hashes: list[int]
    load: Load
    bodies: list[dict[str, Any]] = field(default_factory=list)
    tokenizer_requests: int = 0  # it serves none: each is answered 404
    # Required as `Authorization: Bearer KEY` on every path, as `kvpilot serve --api-key` does.
    api_key: str | None = None
    # The Authorization header of every request that reached it (refused ones too).
    authorizations: list[str | None] = field(default_factory=list)

    @web.middleware
    async def check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("authorization")
        self.authorizations.append(given)
        if self.api_key is not None and given != f"Bearer {self.api_key}":
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        return await handler(request)

    async def tokenizer_file(self, request: web.Request) -> web.Response:
        self.tokenizer_requests += 1
        return web.Response(status=404)

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await response.prepare(request)
        snapshot = KvSnapshot(0, "base", BLOCK_SIZE, HASH_SCHEME, self.hashes, self.load)
        await response.write(msgspec.json.encode(snapshot) + b"\n")
        while True:
            await asyncio.sleep(0.2)
            await response.write(msgspec.json.encode(KvHeartbeat(0, self.load)) + b"\n")

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        return web.json_response(
            {
                "id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [
                    {"index": 0, "text": self.name, "finish_reason": "stop", "logprobs": None}
                ],
                "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 1,
                          "total_tokens": len(PROMPT) + 1},
            }
        )  # fmt: skip


@contextlib.asynccontextmanager
async def serve_stand_in(engine: StandIn) -> AsyncIterator[str]:
    app = web.Application(middlewares=[engine.check_key])
    app.router.add_get(KV_EVENTS_PATH, engine.kv_events)
    app.router.add_post("/v1/completions", engine.completions)
    app.router.add_get(TOKENIZER_FILE_PATH.format(name="{name}"), engine.tokenizer_file)
    runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serve_router(config: RouterConfig, kube: KubeAccess | None = None) -> AsyncIterator[str]:
    async with serve_runtime(RouterRuntime(config, kube)) as url:
        yield url


@contextlib.asynccontextmanager
async def serve_runtime(runtime: RouterRuntime) -> AsyncIterator[str]:
    """A router on loopback (uvicorn, its lifespan run) around a runtime the test can inspect."""
    server = uvicorn.Server(
        uvicorn.Config(create_app(runtime), host="127.0.0.1", port=0, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
