"""The server over an engine core with async scheduling on (what one CUDA rank runs by default),
here on CPU: the core launches step N+1 before it reads step N's tokens, one call late, and
nothing the clients see may change: greedy and seeded outputs equal the steps-in-turn server's,
streamed or not; a client that leaves mid-stream is aborted and its blocks come back."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvpilot.engine.server.inprocess import InProcessServer, serve_in_thread
from kvpilot.engine.server.state import ServerState

from .conftest import start_engine, wait_until_idle

QUESTIONS = ["Name three colors.", "What is 2 + 2?", "Say hello in French."]


@pytest.fixture(scope="module")
def async_server() -> Iterator[InProcessServer]:
    engine = start_engine(async_scheduling=True)
    assert engine.info is not None and engine.info.async_scheduling
    live = serve_in_thread(ServerState(engine))
    yield live
    live.stop()
    engine.shutdown()


def client_of(live: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def answers(live: InProcessServer, model: str, stream: bool, **params: object) -> list[str]:
    client, texts = client_of(live), []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        if stream:
            chunks = client.chat.completions.create(
                model=model, messages=messages, stream=True, **params
            )
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        else:
            reply = client.chat.completions.create(model=model, messages=messages, **params)
            texts.append(reply.choices[0].message.content or "")
    return texts


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.0, "max_tokens": 12}, {"temperature": 1.0, "seed": 7, "max_tokens": 12}],
    ids=["greedy", "seeded"],
)
def test_the_same_answers_as_steps_in_turn(
    async_server: InProcessServer, server: InProcessServer, model_name: str, params: dict
) -> None:
    assert server.state.engine.info is not None
    assert not server.state.engine.info.async_scheduling  # CPU's default: steps in turn
    expected = answers(server, model_name, stream=False, **params)
    assert all(expected)
    assert answers(async_server, model_name, stream=False, **params) == expected
    assert answers(async_server, model_name, stream=True, **params) == expected


def test_a_client_that_leaves_is_aborted_and_its_blocks_come_back(
    async_server: InProcessServer, model_name: str
) -> None:
    idle = wait_until_idle(async_server)
    aborts = "vllm:request_success_total{finished_reason=abort}"
    body = {"model": model_name, "prompt": "Once", "max_tokens": 500, "ignore_eos": True}
    url = f"{async_server.url}/v1/completions"
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json={**body, "stream": True}) as response,
    ):
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 30
    while async_server.metrics()[aborts] - idle[aborts] != 1:
        assert time.monotonic() < deadline, "no abort was counted"
        time.sleep(0.05)
    after = wait_until_idle(async_server, timeout=30)
    assert after["vllm:kv_cache_usage_perc"] == idle["vllm:kv_cache_usage_perc"]
