"""What one forwarded request costs the router's HTTP client: httpx (what the router used) against
aiohttp (what it uses now), both pooled keep-alive clients, on loopback.

A local aiohttp server answers POST /v1/chat/completions with a small JSON body; each client sends
`--requests` requests one at a time (the body the router forwards: ~1.5 kB of chat JSON), reading
the response as the router does (httpx: streamed raw; aiohttp: iter_any). Reported per request:
wall time and this process's CPU time (the server's share, the same for both, included). Two
rounds each; the second is the one reported (the first warms the pool and the code paths).

    python bench/router_client_cost.py --requests 2000
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
from aiohttp import web

ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
        "usage": {"prompt_tokens": 230, "completion_tokens": 1, "total_tokens": 231},
    }
).encode()
REQUEST = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "x " * 750}], "max_tokens": 1}
).encode()
HEADERS = {"content-type": "application/json"}


async def answer(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")


async def timed(send: Callable[[], Awaitable[None]], count: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        await send()
    return (
        1000 * (time.perf_counter() - wall) / count,
        1000 * (time.process_time() - cpu) / count,
    )


async def main(count: int) -> dict[str, dict[str, float]]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
    results = {}
    try:
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(10.0, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        ) as client:

            async def via_httpx() -> None:
                request = client.build_request("POST", url, content=REQUEST, headers=HEADERS)
                response = await client.send(request, stream=True)
                async for _ in response.aiter_raw():
                    pass
                await response.aclose()

            for _ in range(2):
                wall, cpu = await timed(via_httpx, count)
            results["httpx"] = {"wall_ms": wall, "cpu_ms": cpu}
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
            auto_decompress=False,
        ) as session:

            async def via_aiohttp() -> None:
                response = await session.post(url, data=REQUEST, headers=HEADERS)
                async for _ in response.content.iter_any():
                    pass
                response.release()

            for _ in range(2):
                wall, cpu = await timed(via_aiohttp, count)
            results["aiohttp"] = {"wall_ms": wall, "cpu_ms": cpu}
    finally:
        await runner.cleanup()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    import uvloop  # the router's event loop

    for client, figures in uvloop.run(main(args.requests)).items():
        print(f"{client:8} wall {figures['wall_ms']:.3f} ms  cpu {figures['cpu_ms']:.3f} ms")
