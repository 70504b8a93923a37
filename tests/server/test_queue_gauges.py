"""The queue gauges while a step runs: requests added between two steps count as waiting.

The engine step is held open on a gate (a subclass of the real LLMEngine on the bundled model), so
the check reads the gauges at a known point instead of racing a live engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvpilot.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from kvpilot.engine.server.async_engine import AsyncEngine

GATE_TIMEOUT_S = 120.0


class GatedEngine(LLMEngine):
    """Each step waits at a gate until the test lets it through."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.entered = threading.Semaphore(0)
        self.proceed = threading.Semaphore(0)
        self.gated = True

    def step(self):  # type: ignore[no-untyped-def]
        if self.gated:
            self.entered.release()
            if not self.proceed.acquire(timeout=GATE_TIMEOUT_S):
                raise TimeoutError("the test never opened the gate")
        return super().step()


@pytest.fixture
def gated() -> Iterator[tuple[AsyncEngine, list[GatedEngine]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    built: list[GatedEngine] = []

    def build() -> GatedEngine:
        built.append(
            GatedEngine(EngineConfig(max_model_len=512, cache=CacheConfig(kv_cache_gib=0.05)))
        )
        return built[0]

    engine = AsyncEngine(build, registry=CollectorRegistry())
    engine.start()
    assert engine.wait_loaded(timeout=300), f"the engine did not load: {engine.error}"
    yield engine, built
    built[0].gated = False
    built[0].proceed.release()
    engine.shutdown()
    torch.set_num_threads(threads)


async def wait_at_gate(engine: GatedEngine) -> None:
    assert await asyncio.to_thread(engine.entered.acquire, timeout=GATE_TIMEOUT_S)


async def test_requests_added_between_steps_count_as_waiting_during_the_next_step(
    gated: tuple[AsyncEngine, list[GatedEngine]],
) -> None:
    engine, (inner,) = gated
    assert engine.metrics is not None
    labels = {"model_name": inner.model_name}

    def gauge(name: str) -> float | None:
        return engine.metrics.registry.get_sample_value(name, labels)  # type: ignore[union-attr]

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = await engine.add_request("first", [1, 2, 3], params)
    await wait_at_gate(inner)  # step 1 is held before it schedules the first request
    assert engine.num_waiting == 1 and engine.num_running == 0

    # Handed over while step 1 runs: the engine thread applies them only after it.
    later = [
        asyncio.create_task(engine.add_request(f"later-{i}", [4, 5, 6 + i], params))
        for i in range(5)
    ]
    await asyncio.sleep(0.05)
    assert engine.num_waiting == 1 + 5 and engine.num_running == 0

    inner.proceed.release()
    await wait_at_gate(inner)  # the five are added; step 2 is held before it schedules them
    assert [t.done() for t in later] == [True] * 5
    assert engine.num_waiting == 5, "requests just added must not vanish from the queue"
    assert engine.num_running == 1
    assert gauge("vllm:num_requests_waiting") == 5
    assert gauge("kvpilot:num_requests_running") == 1

    inner.gated = False
    inner.proceed.release()
    outputs = [await first.final_output()]
    outputs += [await (await t).final_output() for t in later]
    assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)
