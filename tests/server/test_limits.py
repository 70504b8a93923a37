"""Request limits and hostile bodies: each a clear 4xx with an OpenAI error body, none a 5xx, and
the server serving on; a client that leaves takes all its sequences along, queued ones too."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvpilot.contract.errors import APIError
from kvpilot.contract.limits import RequestLimits, check_json
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.inprocess import InProcessServer
from kvpilot.engine.server.state import ServerSettings

from .conftest import MAX_NUM_SEQS

LIMITS = RequestLimits(
    max_body_bytes=8192,
    max_json_depth=8,
    max_sequences=8,
    max_stop=3,
    max_logit_bias=2,
    max_tokens=64,
)


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
    ("too many logit_bias entries", "/v1/completions",
     json.dumps({"prompt": "hi", "logit_bias": {"1": 1, "2": 1, "3": 1}}).encode(), 400,
     "too_many_logit_bias"),
    ("logit_bias id past the vocabulary", "/v1/completions",
     json.dumps({"prompt": "hi", "logit_bias": {"49152": 1}}).encode(), 400, "logit_bias"),
    ("max_tokens over the limit", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 65}).encode(), 400, "max_tokens"),
    ("best_of counts in the fan-out", "/v1/completions",
     json.dumps({"prompt": ["a", "b", "c"], "n": 3, "best_of": 3}).encode(), 400, "n"),
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


def test_an_absent_max_tokens_is_capped_by_the_limit(tight: InProcessServer) -> None:
    response = httpx.post(
        f"{tight.url}/v1/completions",
        json={"prompt": "Once upon a time", "ignore_eos": True, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == LIMITS.max_tokens


def test_logit_bias_bans_and_forces_tokens_end_to_end(
    server: InProcessServer, engine: AsyncEngine
) -> None:
    """Greedy ids through the real engine core: +100 forces a token, -100 bans the greedy pick."""
    from pathlib import Path

    from kvpilot.engine.model.loader import load_tokenizer

    assert engine.info is not None
    tokenizer = load_tokenizer(Path(engine.info.hf_dir))
    prompt = tokenizer.encode("The capital of France is")

    def greedy_ids(**fields: object) -> list[int]:
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, **fields}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return tokenizer.encode(response.json()["choices"][0]["text"])

    plain = greedy_ids()
    banned = greedy_ids(logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    forced_id = tokenizer.encode(" banana")[0]
    assert forced_id not in plain
    assert greedy_ids(logit_bias={str(forced_id): 100})[:2] == [forced_id] * 2


def test_every_response_carries_a_request_id(tight: InProcessServer) -> None:
    ok = httpx.get(f"{tight.url}/health")
    bad = httpx.post(f"{tight.url}/v1/completions", content=b"{nope")
    ids = {ok.headers["x-request-id"], bad.headers["x-request-id"]}
    assert len(ids) == 2 and all(i.startswith("req-") for i in ids)


def test_a_server_fault_is_a_500_logged_with_its_request_id(
    tight: InProcessServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvpilot.engine.server import app

    async def broken(*_: object) -> None:
        raise RuntimeError("a deliberate fault")

    monkeypatch.setattr(app, "create_completion", broken)
    with caplog.at_level("ERROR", logger="kvpilot.server"):
        response = httpx.post(f"{tight.url}/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["type"] == "internal_error" and request_id in error["message"]
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
