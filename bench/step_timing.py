"""For the step benchmarks: wall time per part of an engine step (calls wrapped in place, methods
or module functions, their seconds summed per label), and the batch of random-token requests
they decode."""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable
from typing import Any


class PartTimes:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def timed(self, inner: Callable[..., Any], label: str) -> Callable[..., Any]:
        """`inner`, adding its wall time to `label` on every call."""

        def call(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            result = inner(*a, **k)
            self.seconds[label] += time.perf_counter() - start
            return result

        return call

    def wrap(self, obj: Any, name: str, label: str) -> None:
        """Replaces obj.name by its timed version."""
        setattr(obj, name, self.timed(getattr(obj, name), label))


def add_random_requests(
    llm: Any, rng: random.Random, count: int, tag: str, max_tokens: int
) -> None:
    """`count` requests of 64-192 random token ids, greedy and ignoring EOS, `max_tokens` each."""
    from kvpilot.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    for i in range(count):
        ids = [rng.randrange(100, 40000) for _ in range(rng.randint(64, 192))]
        llm.engine.add_request(f"{tag}{i}", ids, params)


def finish_prefills(llm: Any) -> None:
    """Steps until no request waits and every running one decodes."""
    scheduler = llm.engine.scheduler
    while scheduler.waiting or any(not s.is_decoding for s in scheduler.running):
        llm.engine.step()
