"""How outputs reach the API side's requests, on the real engine core: a streamed request's
reader is woken once per token-producing step, a non-streamed one once, at its end; the
inter-token latency histogram counts both alike."""

from __future__ import annotations

import json

import httpx
import pytest

from kvpilot.engine import SamplingParams
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.server.async_engine import AsyncEngine, RequestStream
from kvpilot.engine.server.inprocess import InProcessServer

MAX_TOKENS = 6
ITL_COUNT = "vllm:inter_token_latency_seconds_count"


async def outputs_delivered(engine: AsyncEngine, request_id: str, final_only: bool) -> list:
    assert engine.info is not None and engine.info.tokenizer is not None
    prompt = engine.info.tokenizer.encode("The colors of the rainbow are")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    stream = await engine.add_request(request_id, prompt, params, final_only=final_only)
    delivered: list[RequestOutput] = []
    put = stream._put
    # Wrapped before this coroutine yields: nothing can have been delivered yet.
    stream._put = lambda output: (delivered.append(output), put(output))  # type: ignore[method-assign]
    final = await stream.final_output()
    assert final.finished and len(final.outputs[0].token_ids) == MAX_TOKENS
    return delivered


async def test_a_final_only_request_is_woken_once_with_the_whole_output(
    engine: AsyncEngine,
) -> None:
    per_step = await outputs_delivered(engine, "delivery-per-step", final_only=False)
    once = await outputs_delivered(engine, "delivery-final-only", final_only=True)
    assert len(per_step) == MAX_TOKENS
    assert [o.finished for o in once] == [True]
    assert once[0].outputs[0].token_ids == per_step[-1].outputs[0].token_ids
    assert once[0].outputs[0].text == per_step[-1].outputs[0].text


def test_over_http_a_non_streamed_request_is_woken_once_and_both_count_their_gaps(
    server: InProcessServer, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    delivered: list[str] = []
    put = RequestStream._put

    def counting_put(stream: RequestStream, output: RequestOutput) -> None:
        delivered.append(output.request_id)
        put(stream, output)

    monkeypatch.setattr(RequestStream, "_put", counting_put)
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS}
    body |= {"ignore_eos": True, "temperature": 0.0}
    for stream, wakes in ((False, 1), (True, MAX_TOKENS)):
        before = server.metrics()[ITL_COUNT]
        answer = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": stream})
        assert answer.status_code == 200
        first = answer.text.split("\n\n")[0].removeprefix("data: ") if stream else answer.text
        request_id = json.loads(first)["id"]
        assert delivered.count(request_id) == wakes, f"stream={stream}"
        # Each token after the first comes one step after the one before it.
        assert server.metrics()[ITL_COUNT] - before == MAX_TOKENS - 1, f"stream={stream}"
