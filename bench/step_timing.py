"""Wall time per part of an engine step, for the step-split benchmarks: calls are wrapped in
place (methods, module functions) and their seconds summed per label."""

from __future__ import annotations

import collections
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
