"""A bad-input matrix against the real server: every case is a 4xx with an OpenAI error body, the
400s name their parameter where there is one, and the server still serves afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvpilot.engine.server.inprocess import InProcessServer
from kvpilot.engine.server.state import ServerSettings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
LONG = "word " * 2100  # over the test server's 2048-token context
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
TOOL = {"type": "function", "function": {"name": "not a valid name"}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


# (id, method, path, JSON body or raw bytes, expected status, expected param or None)
CASES: list[tuple[str, str, str, Any, int, str | None]] = [
    ("not-json", "POST", CHAT, b"{nope", 400, None),
    ("json-array", "POST", CHAT, b"[1, 2]", 400, None),
    ("no-messages", "POST", CHAT, {"max_tokens": 2}, 400, "messages"),
    ("empty-messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("content-int", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("image-part", "POST", CHAT, {"messages": IMAGE}, 400, "messages"),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature-range", "POST", CHAT, chat(temperature=3), 400, "temperature"),
    ("top-p-zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-k-range", "POST", CHAT, chat(top_k=-2), 400, "top_k"),
    ("min-p-range", "POST", CHAT, chat(min_p=2), 400, "min_p"),
    ("n-zero", "POST", CHAT, chat(n=0), 400, "n"),
    ("n-string", "POST", CHAT, chat(n="2"), 400, "n"),
    ("max-tokens-zero", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-float", "POST", CHAT, chat(max_tokens=2.5), 400, "max_tokens"),
    ("max-tokens-over-context", "POST", CHAT, chat(max_tokens=10**6), 400, "max_tokens"),
    ("prompt-over-context", "POST", CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400,
     "messages"),
    ("prediction-type", "POST", CHAT, chat(prediction={"type": "text", "content": "x"}), 400,
     "prediction"),
    ("prediction-part", "POST", CHAT,
     chat(prediction={"type": "content", "content": [{"type": "image_url", "image_url": {}}]}),
     400, "prediction"),
    ("prediction-over-context", "POST", COMPLETIONS,
     completion(prediction={"type": "content", "content": LONG}), 400, "prediction"),
    ("top-logprobs-range", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top-logprobs-alone", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("logprobs-string", "POST", CHAT, chat(logprobs="yes"), 400, "logprobs"),
    ("stop-ints", "POST", CHAT, chat(stop=[1, 2]), 400, "stop"),
    ("stop-empty", "POST", CHAT, chat(stop=[""]), 400, "stop"),
    ("seed-string", "POST", CHAT, chat(seed="x"), 400, "seed"),
    ("seed-huge", "POST", CHAT, chat(seed=2**70), 400, "seed"),
    ("presence-range", "POST", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    ("stream-string", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream-options-no-stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("tools", "POST", CHAT, chat(tools=[TOOL]), 400, "tools"),
    ("logit-bias-range", "POST", CHAT, chat(logit_bias={"1": 500}), 400, "logit_bias"),
    ("logit-bias-not-an-id", "POST", CHAT, chat(logit_bias={"a": 5}), 400, "logit_bias"),
    ("logit-bias-out-of-vocab", "POST", CHAT, chat(logit_bias={"99999999": 5}), 400,
     "logit_bias"),
    ("logit-bias-negative-id", "POST", CHAT, chat(logit_bias={"-1": 5}), 400, "logit_bias"),
    ("logit-bias-same-id-twice", "POST", CHAT, chat(logit_bias={"1": 5, "01": 3}), 400,
     "logit_bias"),
    ("json-schema-missing", "POST", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format"),
    ("empty-cache-salt", "POST", CHAT, chat(cache_salt=""), 400, "cache_salt"),
    ("unknown-model", "POST", CHAT, chat(model="gpt-17"), 404, "model"),
    ("no-prompt", "POST", COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    ("prompt-empty-list", "POST", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("prompt-empty-string", "POST", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("prompt-empty-ids", "POST", COMPLETIONS, completion(prompt=[[]]), 400, "prompt"),
    ("prompt-id-out-of-vocab", "POST", COMPLETIONS, completion(prompt=[10**7]), 400, "prompt"),
    ("prompt-mixed", "POST", COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt"),
    ("completion-logprobs-range", "POST", COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    ("suffix", "POST", COMPLETIONS, completion(suffix="x"), 400, "suffix"),
    ("echo-with-logprobs", "POST", COMPLETIONS, completion(echo=True, logprobs=1), 400, "echo"),
    ("best-of", "POST", COMPLETIONS, completion(best_of=3), 400, "best_of"),
    ("unknown-route", "GET", "/v1/nope", None, 404, None),
    ("wrong-method", "GET", COMPLETIONS, None, 405, None),
    ("unknown-model-card", "GET", "/v1/models/gpt-17", None, 404, "model"),
]  # fmt: skip


@pytest.fixture(scope="module")
def http(server: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_matrix_is_big_enough() -> None:
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_gets_an_openai_error(
    http: httpx.Client, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        response = http.request(
            method, path, content=body, headers={"content-type": "application/json"}
        )
    else:
        response = http.request(method, path, json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_context_errors_carry_the_numbers(http: httpx.Client) -> None:
    error = http.post(CHAT, json=chat(max_tokens=10**6)).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "2048" in error["message"] and str(10**6) in error["message"]


def test_the_server_still_serves_and_counted_the_rejections(
    http: httpx.Client, server: InProcessServer
) -> None:
    counter = "kvpilot:requests_rejected_total{reason=invalid_request}"
    before = server.metrics()[counter]
    for _, method, path, body, status, _ in CASES[7:12]:
        assert http.request(method, path, json=body).status_code == status == 400
    assert server.metrics()[counter] - before == 5
    response = http.post(CHAT, json=chat(temperature=0))
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"]
    assert http.get("/ready").status_code == 200


def test_api_key_guards_the_api_but_not_the_probes(
    make_server: Callable[[ServerSettings], InProcessServer], model_name: str
) -> None:
    live = make_server(ServerSettings(api_key="s3cret"))
    with httpx.Client(base_url=live.url, timeout=60) as client:
        missing = client.get("/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        wrong = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == model_name
        for probe in ("/health", "/ready", "/metrics"):
            assert client.get(probe).status_code == 200
