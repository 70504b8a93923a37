"""SIGTERM drain of a real `kvpilot serve` process (and its engine-core child) while 8 streams
run."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.inprocess import serve_in_thread
from kvpilot.engine.server.run import DrainingServer
from kvpilot.engine.server.state import ServerState

from .serve_process import ServeProcess, is_running, launch_serve

NUM_STREAMS = 8
MAX_TOKENS = 24


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    with launch_serve(
        "--max-num-seqs", str(NUM_STREAMS), "--max-model-len", "1024", "--kv-cache-gib", "0.1",
        "--shutdown-timeout", "120",
    ) as served:  # fmt: skip
        yield served


async def read_stream(
    http: httpx.AsyncClient, url: str, started: list[int], all_started: asyncio.Event
) -> tuple[list[dict[str, Any]], bool]:
    body = {
        "prompt": "Write a poem about autumn leaves.",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks, True
            chunks.append(json.loads(line[len("data: ") :]))
            if len(chunks) == 1:
                started.append(1)
                if len(started) == NUM_STREAMS:
                    all_started.set()
    return chunks, False


async def test_sigterm_drains_in_flight_streams_then_exits_0(serve: ServeProcess) -> None:
    # The listener opens before the model is loaded: alive (200) but not ready (503) meanwhile.
    assert serve.statuses[0] == (200, 503) and serve.statuses[-1] == (200, 200)
    started: list[int] = []
    all_started = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as http:
        streams = [
            asyncio.create_task(read_stream(http, serve.url, started, all_started))
            for _ in range(NUM_STREAMS)
        ]
        await asyncio.wait_for(all_started.wait(), 120)
        core = serve.core_pid()
        serve.proc.send_signal(signal.SIGTERM)

        # /ready turns 503 at once (within a tick); /health stays 200.
        deadline = time.monotonic() + 5
        while (await http.get(f"{serve.url}/ready")).status_code != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503 after SIGTERM"
            await asyncio.sleep(0.05)
        assert (await http.get(f"{serve.url}/health")).status_code == 200
        refused = await http.post(f"{serve.url}/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert not all(s.done() for s in streams), "the streams ended before the drain was seen"

        results = await asyncio.gather(*streams)

    for chunks, saw_done in results:
        assert saw_done, "a stream was cut before [DONE]"
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert serve.proc.wait(timeout=60) == 0, "".join(serve.log)
    assert any("drained" in line for line in serve.log)
    deadline = time.monotonic() + 10
    while is_running(core):
        assert time.monotonic() < deadline, "the engine core outlived the server"
        time.sleep(0.05)


def test_drain_timeout_cuts_the_rest_with_a_readable_error(
    engine: AsyncEngine, model_name: str
) -> None:
    """In process, on the shared engine: a 1 s --shutdown-timeout against a 1000-token stream."""
    state = ServerState(engine)
    live = serve_in_thread(
        state, make_server=lambda config: DrainingServer(config, state, 1.0, "http://in-process")
    )
    server, url = live.server, live.url
    assert isinstance(server, DrainingServer)
    body = {"model": model_name, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True}
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        events += [next(lines), next(lines)]
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler would call
        signalled = time.monotonic()
        events += list(lines)
    waited = time.monotonic() - signalled
    assert 1.0 <= waited < 10, waited
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "shutdown" and error["type"] == "service_unavailable"
    live.thread.join(15)
    assert not live.thread.is_alive()
    deadline = time.monotonic() + 10
    while engine.num_running or engine.kv_cache_usage:
        assert time.monotonic() < deadline, "the cut request still holds KV blocks"
        time.sleep(0.05)
