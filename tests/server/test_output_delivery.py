"""How outputs reach the API side's requests, on the real engine core: a streamed request's
reader is woken once per token-producing step with what that step added (DELTA), a reader that
fell behind gets the missed outputs merged, a non-streamed one is woken once, at its end; the
inter-token latency histogram counts both alike."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvpilot.engine import SamplingParams
from kvpilot.engine.outputs import OutputKind, RequestOutput
from kvpilot.engine.server.async_engine import AsyncEngine, RequestStream
from kvpilot.engine.server.inprocess import InProcessServer

MAX_TOKENS = 6
ITL_COUNT = "vllm:inter_token_latency_seconds_count"
GENERATED_SUM = "vllm:request_generation_tokens_sum"


def rainbow(engine: AsyncEngine) -> tuple[list[int], SamplingParams]:
    assert engine.info is not None and engine.info.tokenizer is not None
    prompt = engine.info.tokenizer.encode("The colors of the rainbow are")
    return prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


async def outputs_delivered(engine: AsyncEngine, request_id: str, kind: OutputKind) -> list:
    prompt, params = rainbow(engine)
    stream = await engine.add_request(request_id, prompt, params, kind=kind)
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
    per_step = await outputs_delivered(engine, "delivery-per-step", OutputKind.DELTA)
    once = await outputs_delivered(engine, "delivery-final-only", OutputKind.FINAL_ONLY)
    # One token per delta, and the deltas add up to the whole output.
    assert [len(o.outputs[0].token_ids) for o in per_step] == [1] * MAX_TOKENS
    assert [o.finished for o in once] == [True]
    whole = once[0].outputs[0]
    assert [t for o in per_step for t in o.outputs[0].token_ids] == whole.token_ids
    assert "".join(o.outputs[0].text for o in per_step) == whole.text


async def test_a_delta_reader_that_fell_behind_gets_what_it_missed_in_one_output(
    engine: AsyncEngine,
) -> None:
    prompt, params = rainbow(engine)
    whole = (await outputs_delivered(engine, "delivery-whole", OutputKind.FINAL_ONLY))[0]
    stream = await engine.add_request("delivery-late", prompt, params, kind=OutputKind.DELTA)
    deadline = time.monotonic() + 60
    while stream._latest is None or not stream._latest.finished:  # nobody reads meanwhile
        assert time.monotonic() < deadline, "the request did not finish"
        await asyncio.sleep(0.01)
    output = await stream.next_output()
    assert output.finished and output.outputs[0].token_ids == whole.outputs[0].token_ids
    assert output.outputs[0].text == whole.outputs[0].text


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
        before = server.metrics()
        answer = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": stream})
        assert answer.status_code == 200
        first = answer.text.split("\n\n")[0].removeprefix("data: ") if stream else answer.text
        request_id = json.loads(first)["id"]
        assert delivered.count(request_id) == wakes, f"stream={stream}"
        after = server.metrics()
        # Each token after the first comes one step after the one before it.
        assert after[ITL_COUNT] - before[ITL_COUNT] == MAX_TOKENS - 1, f"stream={stream}"
        # The whole request's tokens, though a stream's last output holds only its last step's.
        generated = after[GENERATED_SUM] - before[GENERATED_SUM]
        assert generated == MAX_TOKENS, f"stream={stream}"
