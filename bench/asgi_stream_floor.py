"""What one streamed token costs the API process's event loop, against the floor of a Python
ASGI stream on the same server stack.

Serving on 2 cores loses a few percent against offline to the CPU the API process takes from the
engine core's threads (bench/RESULTS.md, issue 12). This asks how much of kvpilot's event-loop
CPU per token is its own and how much any uvicorn (uvloop + httptools) stream pays: the same
client (aiohttp, `--concurrency` streams at a time, `--requests` requests of `--chunks` chunks
each) reads, in alternating rounds,
- `raw`: a bare ASGI app that sleeps `--gap` s and sends one completion-shaped SSE chunk;
- `starlette`: the same through Starlette's StreamingResponse;
- `kvpilot`: `kvpilot serve --dtype bfloat16 --block-size 32` streaming /v1/completions
  (`--chunks` tokens, ignore_eos), woken by its output thread once per engine step instead of a
  timer;
and prints the server's CPU per chunk: its main thread (the event loop) and the whole process
(kvpilot: also its output and tokenizer threads; never its engine core, a child process).

    python bench/asgi_stream_floor.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import ServerProcess, free_port, kvpilot_serve_cmd

GAP_S = float(os.environ.get("ASGI_FLOOR_GAP_S", "0.05"))
CHUNK = {
    "id": "cmpl-0123456789abcdef0123456789abcdef",
    "object": "text_completion",
    "created": 1764000000,
    "model": "SmolLM2-135M-Instruct",
    "choices": [
        {"index": 0, "text": " token", "logprobs": None, "finish_reason": None, "stop_reason": None}
    ],
    "system_fingerprint": None,
}


async def raw_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI stream: read the body ({"n": chunks}), then n chunks GAP_S apart."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/ready":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for _ in range(json.loads(body)["n"]):
        await asyncio.sleep(GAP_S)
        event = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def stream(request: Request) -> StreamingResponse:
        n = (await request.json())["n"]

        async def events() -> Any:
            for _ in range(n):
                await asyncio.sleep(GAP_S)
                yield b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def ready(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return Starlette(
        routes=[Route("/v1/completions", stream, methods=["POST"]), Route("/ready", ready)]
    )


starlette_app = _starlette_app()


def uvicorn_cmd(app: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", f"asgi_stream_floor:{app}",
        "--app-dir", str(Path(__file__).parent), "--port", str(port),
        "--loop", "uvloop", "--http", "httptools", "--log-level", "warning",
    ]  # fmt: skip


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds so far of the process's main thread (uvicorn's event loop)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Workload:
    requests: int
    chunks: int  # per request
    concurrency: int


async def stream_all(url: str, workload: Workload, kvpilot: bool) -> int:
    """Every request's stream read to its end; returns the number of data chunks (not [DONE])."""
    prompt = "Tell me about the history of the city and its rivers. " * 11  # ~128 tokens
    body: dict[str, Any] = {"n": workload.chunks}
    if kvpilot:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": workload.chunks,
                "ignore_eos": True, "stream": True}  # fmt: skip
    gate = asyncio.Semaphore(workload.concurrency)
    chunks = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal chunks
        async with gate, session.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    chunks += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session) for _ in range(workload.requests)))
    return chunks


def measure(
    server: ServerProcess, url: str, workload: Workload, kvpilot: bool
) -> tuple[float, float]:
    """(event loop, whole process) microseconds of server CPU per streamed chunk."""
    pid = server.proc.pid
    loop0, proc0 = main_thread_cpu_s(pid), server.api_cpu_seconds()
    chunks = asyncio.run(stream_all(url, workload, kvpilot))
    loop1, proc1 = main_thread_cpu_s(pid), server.api_cpu_seconds()
    return (loop1 - loop0) / chunks * 1e6, (proc1 - proc0) / chunks * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    workload = Workload(args.requests, args.chunks, args.concurrency)
    warm = replace(workload, requests=workload.concurrency, chunks=8)
    servers = {
        "raw": ServerProcess("raw", uvicorn_cmd("raw_app", p := free_port()), "/ready", p),
        "starlette": ServerProcess(
            "starlette", uvicorn_cmd("starlette_app", q := free_port()), "/ready", q
        ),
        "kvpilot": ServerProcess(
            "kvpilot",
            kvpilot_serve_cmd(["--dtype", "bfloat16", "--block-size", "32"]),
            "/ready",
        ),
    }
    try:
        urls = {name: server.wait_ready() for name, server in servers.items()}
        for name, server in servers.items():  # unmeasured: first-call costs
            measure(server, urls[name], warm, name == "kvpilot")
        names = list(servers)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                time.sleep(2)  # let the last run's stragglers settle
                got = measure(servers[name], urls[name], workload, name == "kvpilot")
                results[name].append(got)
                print(f"round {r + 1} {name:>9}: event loop {got[0]:6.1f} us/chunk, "
                      f"process {got[1]:6.1f} us/chunk", flush=True)  # fmt: skip
        print(f"\n{'server':>9}  {'event loop us/chunk':>20}  {'process us/chunk':>17}")
        for name in names:
            loop = statistics.median(x[0] for x in results[name])
            proc = statistics.median(x[1] for x in results[name])
            print(f"{name:>9}  {loop:20.1f}  {proc:17.1f}")
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
