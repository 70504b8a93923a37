"""Request limits and hostile bodies: each a clear 4xx with an OpenAI error body, none a 5xx, and
the server serving on; a client that leaves takes all its sequences along, queued ones too."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.inprocess import InProcessServer
from kvpilot.engine.server.limits import RequestLimits, check_json
from kvpilot.engine.server.state import ServerSettings

from .conftest import MAX_NUM_SEQS

LIMITS = RequestLimits(max_body_bytes=8192, max_json_depth=8, max_sequences=8, max_stop=3)


@pytest.fixture(scope="module")
def tight(engine: object) -> Iterator[InProcessServer]:
    from kvpilot.engine.server.inprocess import serve_in_thread
    from kvpilot.engine.server.state import ServerState

    live = serve_in_thread(ServerState(engine, ServerSettings(limits=LIMITS)))  # type: ignore[arg-type]
    yield live
    live.stop()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


CASES: list[tuple[str, str, bytes, int, str | None]] = [
    # (name, path, raw body, status, error code or param)
    ("body over the limit", "/v1/completions",
     json.dumps({"prompt": "x" * 9000}).encode(), 413, "request_too_large"),
    ("nested past the limit", "/v1/completions",
     b'{"prompt": "hi", "extra": ' + nested(20).encode() + b"}", 400, "json_too_deep"),
    ("nested past the parser's stack", "/v1/completions",
     b'{"prompt": "hi", "x": ' + nested(3000).encode() + b"}", 400, "json_too_deep"),
    ("lone surrogate in a prompt", "/v1/completions",
     b'{"prompt": "hello \\ud800 world"}', 400, "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', 400, "messages"),
    ("lone surrogate in a key", "/v1/completions",
     b'{"prompt": "hi", "\\ud800": 1}', 400, None),
    ("too many sequences", "/v1/completions",
     json.dumps({"prompt": ["a", "b", "c"], "n": 3}).encode(), 400, "n"),
    ("too many stop strings", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "hi"}],
                 "stop": ["a", "b", "c", "d"]}).encode(), 400, "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "path", "body", "status", "code_or_param"), CASES)
def test_hostile_bodies_get_a_clear_4xx(
    tight: InProcessServer,
    name: str,
    path: str,
    body: bytes,
    status: int,
    code_or_param: str | None,
) -> None:
    response = httpx.post(
        f"{tight.url}{path}", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, (name, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    if code_or_param is not None:
        assert code_or_param in (error["code"], error["param"]), error


def test_a_body_without_a_declared_length_is_cut_at_the_limit(tight: InProcessServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1000  # 100 kB in all, sent chunked
        yield b'"}'

    response = httpx.post(f"{tight.url}/v1/completions", content=chunks())
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"


def test_the_server_still_serves_after_the_hostile_ones(
    tight: InProcessServer, server: InProcessServer, model_name: str
) -> None:
    deep = b'{"prompt": "hi", "x": ' + nested(100_000).encode() + b"}"
    assert httpx.post(f"{server.url}/v1/completions", content=deep).status_code == 400
    for live in (tight, server):
        ok = httpx.post(
            f"{live.url}/v1/completions",
            json={"model": model_name, "prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        assert ok.status_code == 200, ok.text


def test_check_json_names_the_field_and_counts_depth() -> None:
    check_json({"a": [[["ok"]]]}, 4)
    with pytest.raises(APIError, match="deeper than 3"):
        check_json({"a": [[["x"]]]}, 3)
    with pytest.raises(APIError, match=r"messages\.0\.content"):
        check_json({"messages": [{"content": "a\ud800"}]}, 8)


def test_a_disconnect_removes_every_sequence_queued_or_running(
    server: InProcessServer, model_name: str, wait_idle: Callable[..., dict[str, float]]
) -> None:
    """More sequences than the running batch holds (MAX_NUM_SEQS): some wait in the queue when
    the client leaves; every one of them goes, the queue and the KV cache empty."""
    idle = wait_idle(server)
    num_prompts, n = 6, 4
    assert num_prompts * n > MAX_NUM_SEQS
    body = {
        "model": model_name,
        "prompt": [f"Story number {i}:" for i in range(num_prompts)],
        "n": n,
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as response,
    ):
        lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        next(lines)
        deadline = time.monotonic() + 30
        while True:
            during = server.metrics()
            if during["vllm:num_requests_waiting"] > 0 and during["vllm:num_requests_running"]:
                break
            assert time.monotonic() < deadline, during
            time.sleep(0.05)
    after = wait_idle(server, timeout=15)
    assert after["vllm:kv_cache_usage_perc"] == idle["vllm:kv_cache_usage_perc"]
    aborts = "vllm:request_success_total{finished_reason=abort}"
    assert after[aborts] - idle[aborts] == num_prompts  # one engine request per prompt
