"""Keep the garbage collector's full collections short in long-running processes.

A process that has imported torch, transformers and a tokenizer holds a few hundred thousand
long-lived container objects. CPython's oldest generation is collected whenever enough new objects
survive into it, and each such collection walks every one of them while holding the interpreter
lock: 100-150 ms of CPU on the development VM for `kvpilot serve`'s API process, during which its
event loop answers nothing (not even /health) and the engine core takes no step. What exists once
startup is over lives until exit, so it is moved out of the collector's sight (`gc.freeze`, as
vLLM's API server does after its start); collections then walk only what serving allocated.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Frozen:
    objects: int  # objects now in the permanent generation
    seconds: float  # the one full collection before freezing


def freeze_startup_objects(what: str) -> Frozen:
    """Collect once (so that startup's garbage is freed, not frozen), then freeze what survives.
    Call it once a process has loaded everything it keeps: later calls freeze more, harmlessly."""
    started = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - started
    gc.freeze()
    frozen = Frozen(objects=gc.get_freeze_count(), seconds=seconds)
    log.debug("%s: %d startup objects frozen (full collection %.0f ms)", what, frozen.objects,
              1000 * seconds)  # fmt: skip
    return frozen
