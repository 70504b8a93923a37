"""The queue gauges while the engine core is busy: requests handed over count as waiting until the
core reports them, and never vanish from both counts.

The core process is frozen with SIGSTOP (a real core on the bundled model, held at a known point
instead of racing it), requests are sent, and the gauges are read; then it runs on with SIGCONT.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvpilot.engine import CacheConfig, EngineConfig, SamplingParams
from kvpilot.engine.server.async_engine import AsyncEngine


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    config = EngineConfig(max_model_len=512, cache=CacheConfig(kv_cache_gib=0.05))
    engine = AsyncEngine(config, registry=CollectorRegistry(), core_threads=1)
    engine.start()
    assert engine.wait_loaded(timeout=300), f"the engine did not load: {engine.error}"
    yield engine
    assert engine.core_pid is not None
    os.kill(engine.core_pid, signal.SIGCONT)
    engine.shutdown()


async def test_requests_sent_to_a_busy_core_count_as_waiting_and_never_vanish(
    engine: AsyncEngine,
) -> None:
    assert engine.metrics is not None and engine.info is not None and engine.core_pid is not None
    labels = {"model_name": engine.info.model_name}

    def gauge(name: str) -> float | None:
        engine_index = {"engine": "0"} if name.startswith("vllm:") else {}  # vLLM's label
        return engine.metrics.registry.get_sample_value(name, {**labels, **engine_index})  # type: ignore[union-attr]

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    os.kill(engine.core_pid, signal.SIGSTOP)
    streams = [await engine.add_request(f"r{i}", [4, 5, 6 + i], params) for i in range(6)]
    await asyncio.sleep(0.2)
    assert engine.num_waiting == 6 and engine.num_running == 0
    assert gauge("vllm:num_requests_waiting") == 6
    assert gauge("kvpilot:num_requests_running") == 0

    os.kill(engine.core_pid, signal.SIGCONT)
    finals = [asyncio.ensure_future(s.final_output()) for s in streams]
    samples = []
    deadline = time.monotonic() + 120
    while not all(f.done() for f in finals):
        assert time.monotonic() < deadline, "the requests did not finish"
        waiting, running, unfinished = engine.queue_counts()
        samples.append((unfinished, waiting, running))
        assert waiting + running == unfinished, samples[-5:]
        await asyncio.sleep(0.002)
    assert any(running > 0 for _, _, running in samples), "the core never reported running ones"
    outputs = [f.result() for f in finals]
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    assert engine.num_waiting == 0 and engine.num_running == 0
