"""The official openai client, sync and async, against the real server and the real SmolLM2."""

from __future__ import annotations

import openai
import pytest

from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.inprocess import InProcessServer

QUESTION = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(server: InProcessServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_models_lists_the_served_model(client: openai.OpenAI, model_name: str) -> None:
    assert [m.id for m in client.models.list().data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name


def test_chat_non_streaming_and_streaming_agree(client: openai.OpenAI, model_name: str) -> None:
    full = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=10, temperature=0
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.completion_tokens <= 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=QUESTION,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"  # the role delta comes first
    content = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert "".join(c.choices[0].delta.content or "" for c in content) == choice.message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # the usage chunk is last
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_non_streaming_and_streaming_agree(
    client: openai.OpenAI, model_name: str
) -> None:
    full = client.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    text = full.choices[0].text
    assert text and full.usage is not None and full.usage.completion_tokens == 8
    stream = client.completions.create(
        model=model_name,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_accept_token_ids_and_batches(client: openai.OpenAI, model_name: str) -> None:
    by_text = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=4, temperature=0
    )
    batch = client.completions.create(
        model=model_name, prompt=["Once upon a time", "One, two,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage is not None and by_text.usage is not None
    assert batch.usage.completion_tokens == 8
    token_ids = client.completions.create(
        model=model_name,
        prompt=[9, 1035, 1141, 253],
        max_tokens=3,
        temperature=0,
        echo=True,
    )
    assert token_ids.usage is not None and token_ids.usage.prompt_tokens == 4
    assert token_ids.choices[0].text  # echo puts the decoded prompt first


def test_n_choices_streamed_and_not(client: openai.OpenAI, model_name: str) -> None:
    full = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=6, n=2, temperature=1.0, seed=11
    )
    assert sorted(c.index for c in full.choices) == [0, 1]
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=QUESTION,
            max_tokens=6,
            n=2,
            temperature=1.0,
            seed=11,
            stream=True,
        )
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    # Same seed: the stream reproduces the non-streamed choices exactly.
    assert texts == {c.index: c.message.content for c in full.choices}


def test_seed_reproduces_sampling(client: openai.OpenAI, model_name: str) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=model_name, prompt="My favourite animal is", max_tokens=8, seed=seed
        )
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1  # temperature 1: seeds matter


def test_stop_string_cuts_the_text(client: openai.OpenAI, model_name: str) -> None:
    prompt = "Count: 1, 2, 3, 4, 5,"
    free = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    text = free.choices[0].text
    stop = text.strip()[1:3] if len(text.strip()) > 3 else text[:1]
    assert stop and stop in text
    cut = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=8, temperature=0, stop=[stop, "zzz"]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name,
        messages=QUESTION,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
        assert bytes(entry.bytes) == entry.token.encode()
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completion_logprobs(client: openai.OpenAI, model_name: str) -> None:
    r = client.completions.create(
        model=model_name, prompt="Water is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and top[token] == value == max(top.values())


def test_repeated_prefix_reports_cached_tokens(
    client: openai.OpenAI, model_name: str, engine: AsyncEngine, server: InProcessServer
) -> None:
    system = "You are a meticulous assistant who answers in one short sentence. " * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]
    hits_before = server.metrics()["vllm:prefix_cache_hits_total"]
    first = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=2, temperature=0
    )
    second = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens > 2 * engine.info.block_size
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - engine.info.block_size  # all full blocks hit
    assert cached % engine.info.block_size == 0 and cached < second.usage.prompt_tokens
    assert server.metrics()["vllm:prefix_cache_hits_total"] - hits_before >= cached
    # Another tenant's salt shares nothing.
    salted = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_body={"cache_salt": "tenant-b"},
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


async def test_async_client_chat_and_completion_streams(
    aclient: openai.AsyncOpenAI, model_name: str
) -> None:
    r = await aclient.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=6, temperature=0
    )
    stream = await aclient.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=6, temperature=0, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == r.choices[0].message.content
    completion = await aclient.completions.create(
        model=model_name,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in completion]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    await aclient.close()
