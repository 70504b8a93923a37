"""Request priority and shared prefixes on a real server (the bundled model behind uvicorn on
loopback): `priority` needs --scheduling-policy priority; a better request submitted while the
batch is full of worse ones starts before the worse ones queued ahead of it; two salts share
exactly the blocks of kvpilot_shared_prefix_tokens."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvpilot.contract.tenancy import unsalted_blocks
from kvpilot.engine import CacheConfig, EngineConfig, SchedulerConfig
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.inprocess import InProcessServer, serve_in_thread
from kvpilot.engine.server.state import ServerState

MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def priority_server() -> Iterator[InProcessServer]:
    config = EngineConfig(
        max_model_len=512,
        async_scheduling=True,  # as on one GPU: preemption with a token in flight
        cache=CacheConfig(kv_cache_gib=0.25),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, policy="priority"),
    )
    engine = AsyncEngine(config, registry=CollectorRegistry(), core_threads=1)
    engine.start()
    assert engine.wait_loaded(timeout=300), f"the engine did not load: {engine.error}"
    assert engine.info is not None and engine.info.async_scheduling
    live = serve_in_thread(ServerState(engine))
    yield live
    live.stop()
    engine.shutdown()


def completion(live: InProcessServer, **body: object) -> httpx.Response:
    info = live.state.engine.info
    assert info is not None
    return httpx.post(
        f"{live.url}/v1/completions", json={"model": info.model_name, **body}, timeout=120
    )


def test_priority_needs_the_priority_policy(server: InProcessServer, model_name: str) -> None:
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 1, "priority": -1}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "priority" and "Priority scheduling is not enabled" in error["message"]
    chat = {**body, "messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    # Priority 0 is every request's default: accepted under fcfs.
    assert httpx.post(
        f"{server.url}/v1/completions", json={**body, "priority": 0}, timeout=60
    ).is_success


def test_priority_is_an_integer(priority_server: InProcessServer) -> None:
    response = completion(priority_server, prompt="Hi", max_tokens=1, priority="high")
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    declared = {"prompt": "Hi", "max_tokens": 1, "priority": 1}
    response = completion(priority_server, **declared, kvpilot_guard_priority="premium")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kvpilot_guard_priority"
    assert completion(priority_server, **declared, kvpilot_guard_priority=-2).is_success


def test_a_better_request_starts_before_worse_ones_queued_ahead_of_it(
    priority_server: InProcessServer,
) -> None:
    info = priority_server.state.engine.info
    assert info is not None and info.max_num_seqs == MAX_NUM_SEQS
    engine = priority_server.state.engine
    order: list[str] = []  # request names, as each one's first token arrives
    lock = threading.Lock()
    started = {name: threading.Event() for name in ("long0", "long1", "queued0", "queued1", "high")}
    stop = threading.Event()

    def stream(name: str, priority: int, max_tokens: int) -> None:
        body = {
            "model": info.model_name,
            "prompt": f"Count slowly from one, request {name}:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "priority": priority,
        }
        with httpx.stream(
            "POST", f"{priority_server.url}/v1/completions", json=body, timeout=120
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {") and not started[name].is_set():
                    with lock:
                        order.append(name)
                    started[name].set()
                if stop.is_set():
                    return  # closing the stream aborts the request

    threads = []

    def launch(name: str, priority: int, max_tokens: int) -> None:
        thread = threading.Thread(target=stream, args=(name, priority, max_tokens), daemon=True)
        thread.start()
        threads.append(thread)

    try:
        # The batch fills with two long low-priority generations.
        launch("long0", 1, 400)
        launch("long1", 1, 400)
        assert started["long0"].wait(60) and started["long1"].wait(60)
        # Two more low-priority requests queue behind them.
        launch("queued0", 1, 2)
        launch("queued1", 1, 2)
        deadline = time.monotonic() + 60
        while engine.num_waiting < 2:  # the engine has them queued (no slot for them)
            assert time.monotonic() < deadline and not started["queued0"].is_set(), order
            stop.wait(0.01)
        preemptions_before = priority_server.metrics()["kvpilot:num_preemptions_total"]
        launch("high", -1, 2)
        assert started["high"].wait(60), order
        assert not started["queued0"].is_set() and not started["queued1"].is_set(), order
        assert order[:3] == ["long0", "long1", "high"] or order[:3] == ["long1", "long0", "high"]
        # It took the place of a running long one (preempted, to be recomputed).
        assert priority_server.metrics()["kvpilot:num_preemptions_total"] > preemptions_before
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def test_salted_requests_share_exactly_the_shared_prefix_blocks(
    priority_server: InProcessServer,
) -> None:
    info = priority_server.state.engine.info
    assert info is not None
    block_size = info.block_size
    prompt = [(11 * i + 5) % 900 + 200 for i in range(5 * block_size + 3)]
    shared = 2 * block_size + block_size // 2  # two whole blocks and half of a third

    def cached_tokens(salt: str, shared_tokens: int) -> int:
        body = {
            "prompt": prompt,
            "max_tokens": 1,
            "cache_salt": salt,
            "kvpilot_shared_prefix_tokens": shared_tokens,
        }
        response = completion(priority_server, **body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached_tokens("tenant:a", shared) == 0
    expected = unsalted_blocks(shared, block_size) * block_size
    assert cached_tokens("tenant:b", shared) == expected == 2 * block_size
    # Without the shared prefix a third salt shares nothing.
    assert cached_tokens("tenant:c", 0) == 0
    # The field must be a non-negative integer.
    response = completion(priority_server, prompt=prompt, kvpilot_shared_prefix_tokens=-1)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kvpilot_shared_prefix_tokens"
