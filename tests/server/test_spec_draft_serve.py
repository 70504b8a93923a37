"""Draft-model speculation through the OpenAI server, on the real SmolLM2: the bundled model as its
own draft (builtin://), greedy chat answers those of the server without speculation, and the
counters on /metrics under vLLM's names."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvpilot.engine.config import SpeculativeConfig
from kvpilot.engine.server.inprocess import InProcessServer, serve_in_thread
from kvpilot.engine.server.state import ServerState

from .conftest import start_engine
from .serve_process import spec_counters

QUESTIONS = ["Name three colors.", "What is the capital of France?"]
SPEC = SpeculativeConfig(model="builtin://smollm2-135m-instruct", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def draft_server() -> Iterator[InProcessServer]:
    engine = start_engine(speculative=SPEC)
    live = serve_in_thread(ServerState(engine))
    yield live
    live.stop()
    engine.shutdown()


def answers(live: InProcessServer, model: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=300)
    return [
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            temperature=0.0,
            max_tokens=16,
        )
        .choices[0]
        .message.content
        or ""
        for question in QUESTIONS
    ]


def test_greedy_answers_with_the_model_as_its_own_draft(
    draft_server: InProcessServer, server: InProcessServer, model_name: str
) -> None:
    expected = answers(server, model_name)
    assert all(expected)
    assert answers(draft_server, model_name) == expected
    seen = spec_counters(draft_server.url)
    drafted = seen["vllm:spec_decode_num_draft_tokens_total"]
    assert seen["vllm:spec_decode_num_drafts_total"] > 0 and drafted > 0
    # The same weights propose what the target then picks: (nearly) every proposal is taken
    # (a near tie may round apart between the draft's and the target's batch shapes).
    assert seen["vllm:spec_decode_num_accepted_tokens_total"] >= 0.9 * drafted
