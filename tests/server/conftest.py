"""Real servers for the server tests: the bundled SmolLM2 engine core, in its own process, loaded
once per session, behind two real uvicorn servers on 127.0.0.1 (ephemeral ports), each on its own
thread and event loop.

`server` is the ordinary one; `strict_server` shares the same engine but refuses requests as soon as
two are waiting (--max-queue 2), so the 429 path runs against the real scheduler state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvpilot.engine import CacheConfig, EngineConfig, SchedulerConfig
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.inprocess import InProcessServer, serve_in_thread
from kvpilot.engine.server.state import ServerSettings, ServerState

MAX_NUM_SEQS = 16  # below the 32-request load test, so some requests must wait
MAX_MODEL_LEN = 2048
STRICT_MAX_QUEUE = 2


def start_engine(**config: object) -> AsyncEngine:
    """The bundled SmolLM2 behind an AsyncEngine, loaded; `config`: more EngineConfig fields."""
    # The engine core runs in its own process. On 2 cores, one intra-op thread there leaves a core
    # for this process's uvicorn loops and test clients.
    engine_config = EngineConfig(
        max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(kv_cache_gib=0.25),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS),
        **config,  # type: ignore[arg-type]
    )
    async_engine = AsyncEngine(engine_config, registry=CollectorRegistry(), core_threads=1)
    async_engine.start()
    assert async_engine.wait_loaded(timeout=300), f"the engine did not load: {async_engine.error}"
    return async_engine


@pytest.fixture(scope="session")
def engine() -> Iterator[AsyncEngine]:
    async_engine = start_engine()
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="session")
def server(engine: AsyncEngine) -> Iterator[InProcessServer]:
    live = serve_in_thread(ServerState(engine))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def strict_server(engine: AsyncEngine) -> Iterator[InProcessServer]:
    live = serve_in_thread(ServerState(engine, ServerSettings(max_queue=STRICT_MAX_QUEUE)))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def model_name(engine: AsyncEngine) -> str:
    assert engine.info is not None
    return engine.info.model_name


def wait_until_idle(live: InProcessServer, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = live.metrics()
        if m["kvpilot:num_requests_running"] == 0 and m["kvpilot:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not go idle: {m}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def wait_idle() -> Callable[..., dict[str, float]]:
    return wait_until_idle


@pytest.fixture
def make_server(engine: AsyncEngine) -> Iterator[Callable[[ServerSettings], InProcessServer]]:
    """Start extra servers on the shared engine with other settings; stopped after the test."""
    started: list[InProcessServer] = []

    def make(settings: ServerSettings) -> InProcessServer:
        started.append(serve_in_thread(ServerState(engine, settings)))
        return started[-1]

    yield make
    for live in started:
        live.stop()
