"""Concurrency against the real server: 32 streams, the queue and its metrics, 429, disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import openai

from kvpilot.engine.server.inprocess import InProcessServer

TOPICS = ["the sea", "mountains", "bread", "trains", "owls", "rain", "music", "glass"]
PROMPTS = [f"Fact {i} about {TOPICS[i % len(TOPICS)]}:" for i in range(32)]
MAX_TOKENS = 6


async def stream_text(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts, finish = [], None
    async for chunk in stream:
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    return "".join(parts)


async def test_32_concurrent_streams_match_solo_runs_and_move_the_metrics(
    server: InProcessServer,
    strict_server: InProcessServer,
    model_name: str,
    wait_idle: Callable[..., dict[str, float]],
) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    wait_idle(server)
    before = server.metrics()
    seen = {"waiting": 0.0, "running": 0.0, "in_flight": 0.0}
    samples: list[dict[str, float]] = []  # every scrape, for the failure message
    strict_status: list[httpx.Response] = []

    async def watch(http: httpx.AsyncClient, done: asyncio.Event) -> None:
        while not done.is_set():
            text = (await http.get(f"{server.url}/metrics")).text
            values = {
                line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(("vllm:num_requests", "kvpilot:num_requests_in_flight"))
            }
            samples.append(values)
            seen["waiting"] = max(seen["waiting"], values["vllm:num_requests_waiting"])
            seen["running"] = max(seen["running"], values["vllm:num_requests_running"])
            seen["in_flight"] = max(seen["in_flight"], values["kvpilot:num_requests_in_flight"])
            if values["vllm:num_requests_waiting"] >= 8 and not strict_status:
                # The strict server shares this engine: its queue is over --max-queue 2 now.
                strict_status.append(
                    await http.post(
                        f"{strict_server.url}/v1/completions",
                        json={"model": model_name, "prompt": "hi", "max_tokens": 1},
                    )
                )
            await asyncio.sleep(0.05)

    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as http:
        watcher = asyncio.create_task(watch(http, done))
        together = await asyncio.gather(*(stream_text(client, model_name, p) for p in PROMPTS))
        done.set()
        await watcher

    assert all(len(t) > 0 for t in together)
    # Batched, capped by max_num_seqs; 32 requests for 16 slots, so some wait.
    assert 2 <= seen["running"] <= 16, samples
    assert seen["waiting"] >= 8, samples
    assert seen["in_flight"] >= 16, samples
    after = wait_idle(server)
    gen = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert gen == 32 * MAX_TOKENS
    done_length = "vllm:request_success_total{finished_reason=length}"
    assert after[done_length] - before[done_length] == 32
    assert (
        after["vllm:time_to_first_token_seconds_count"]
        - before["vllm:time_to_first_token_seconds_count"]
        == 32
    )

    (rejected,) = strict_status
    assert rejected.status_code == 429, (rejected.text, samples)
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["code"] == "queue_full"
    # Idle again: the strict server serves.
    ok = httpx.post(
        f"{strict_server.url}/v1/completions",
        json={"model": model_name, "prompt": "hi", "max_tokens": 1},
        timeout=60,
    )
    assert ok.status_code == 200

    # Each greedy output equals the same request run alone.
    alone = [await stream_text(client, model_name, p) for p in PROMPTS]
    mismatches = [(p, a, b) for p, a, b in zip(PROMPTS, alone, together, strict=True) if a != b]
    assert not mismatches
    await client.close()


def test_disconnect_mid_stream_frees_the_blocks(
    server: InProcessServer, model_name: str, wait_idle: Callable[..., dict[str, float]]
) -> None:
    idle = wait_idle(server)
    idle_usage = idle["vllm:kv_cache_usage_perc"]
    aborts = "vllm:request_success_total{finished_reason=abort}"
    body = {
        "model": model_name,
        "prompt": "Tell me a very long story about a dragon. " * 8,
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        received = 0
        while received < 3:
            if next(lines).startswith("data: {"):
                received += 1
        during = server.metrics()
        assert during["vllm:num_requests_running"] == 1
        assert during["vllm:kv_cache_usage_perc"] > idle_usage
    # Leaving the block closed the connection mid-stream.
    after = wait_idle(server, timeout=10)
    assert after["vllm:kv_cache_usage_perc"] == idle_usage
    assert after[aborts] - idle[aborts] == 1
    assert after["vllm:generation_tokens_total"] - idle["vllm:generation_tokens_total"] < 500


def test_non_streaming_client_timeout_aborts_too(
    server: InProcessServer, model_name: str, wait_idle: Callable[..., dict[str, float]]
) -> None:
    idle = wait_idle(server)
    body = {"model": model_name, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True}
    start = time.monotonic()
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
        raise AssertionError("a 1000-token completion should not finish in 1.5 s on CPU")
    except httpx.ReadTimeout:
        pass
    after = wait_idle(server, timeout=10)
    assert time.monotonic() - start < 12
    assert after["vllm:kv_cache_usage_perc"] == idle["vllm:kv_cache_usage_perc"]
    aborts = "vllm:request_success_total{finished_reason=abort}"
    assert after[aborts] - idle[aborts] == 1
