"""Property-based test of the HTTP API from its own OpenAPI document (app.openapi(), whose request
bodies are the pydantic models that validate them): schemathesis generates requests for every
operation, valid ones and ones that break the schema, and sends them to a real uvicorn server on
loopback in front of the real engine core. None may be answered 5xx; every 4xx carries an
OpenAI error body; the server still serves afterwards.

Every operation is reached (checked). Generation stays tiny so that hundreds of requests fit in
the test budget: this server caps max_tokens at 2 (--max-tokens-limit: larger asks are a 400,
absent ones capped) and fan-out at 4 sequences per request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.contract.limits import RequestLimits
from kvpilot.engine.server.app import openapi_document
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.inprocess import InProcessServer, serve_in_thread
from kvpilot.engine.server.state import ServerSettings, ServerState

NUM_REQUESTS = 600
# Requests are drawn in batches and each batch sent by concurrent clients, so the engine batches
# their (tiny) generations as it would a real load.
BATCH = 20
CLIENTS = 16
ENDLESS_STREAMS = {"/kvpilot/v1/kv-events"}
CLIENT_KEEPALIVE_S = 4.0
LIMITS = RequestLimits(max_tokens=2, max_sequences=4, max_body_bytes=256 * 1024)


@pytest.fixture(scope="module")
def fuzzed(engine: AsyncEngine) -> Iterator[InProcessServer]:
    live = serve_in_thread(ServerState(engine, ServerSettings(limits=LIMITS)))
    yield live
    live.stop()


def fuzzed_operations(document: dict[str, object]) -> list[object]:
    schema = schemathesis.openapi.from_dict(document)
    # The block-event stream for routers never ends by design (heartbeats keep it open): a
    # request to it has no response to judge; tests/server/test_kv_events_http.py covers it.
    return [
        op
        for op in (result.ok() for result in schema.get_all_operations())
        if op.path not in ENDLESS_STREAMS
    ]


def strategies(operations: list[object]) -> st.SearchStrategy[schemathesis.Case]:
    positive, negative = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
    # Bodies both ways; the parameterless GETs have nothing to break (negative is unsatisfiable).
    return st.one_of(
        *(op.as_strategy(generation_mode=positive) for op in operations),
        *(op.as_strategy(generation_mode=negative) for op in operations if op.method == "post"),
    )


@pytest.mark.slow
def test_no_generated_request_gets_a_5xx(fuzzed: InProcessServer, model_name: str) -> None:
    document = openapi_document(fuzzed.server.config.app)  # the document of the app served
    operations = fuzzed_operations(document)
    statuses: Counter[int] = Counter()
    reached: Counter[tuple[str, str]] = Counter()
    bad: list[str] = []
    # Idle connections dropped before uvicorn closes them (5 s): with httpx's default of 5 s too,
    # a connection reused as the server closes it was reset mid-request when a slow (loaded)
    # batch left it idle that long.
    limits = httpx.Limits(max_connections=CLIENTS, keepalive_expiry=CLIENT_KEEPALIVE_S)
    session = httpx.Client(base_url=fuzzed.url, timeout=120, limits=limits)

    @settings(
        max_examples=NUM_REQUESTS // BATCH,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases=st.lists(strategies(operations), min_size=BATCH, max_size=BATCH))
    def send_batch(cases: list[schemathesis.Case]) -> None:
        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(send, cases))

    def send(case: schemathesis.Case) -> None:
        kwargs = case.as_transport_kwargs(base_url=fuzzed.url)
        response = session.request(
            kwargs["method"],
            kwargs["url"],
            params=kwargs.get("params"),
            headers=kwargs.get("headers"),
            content=kwargs.get("data"),
            json=kwargs.get("json"),
        )
        statuses[response.status_code] += 1
        reached[(case.method.upper(), case.path)] += 1
        if response.status_code >= 500:
            bad.append(f"{case.method} {case.path} {kwargs.get('json')!r}: {response.text}")
        elif response.status_code >= 400 and case.path.startswith("/v1"):
            error = response.json().get("error", {})
            if set(error) != {"message", "type", "param", "code"} or not error["message"]:
                bad.append(f"not an OpenAI error body: {response.text}")

    send_batch()
    session.close()
    total = sum(statuses.values())
    print(f"{total} requests: {dict(sorted(statuses.items()))}; {dict(reached)}")
    assert not bad, bad[:5]
    assert total >= NUM_REQUESTS
    every = {(op.method.upper(), op.path) for op in operations}  # type: ignore[attr-defined]
    assert set(reached) == every, every - set(reached)
    assert statuses[200] > 100 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 100
    ok = httpx.post(
        f"{fuzzed.url}/v1/completions",
        json={"model": model_name, "prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    assert httpx.get(f"{fuzzed.url}/health").status_code == 200
