"""torch's intra-op threads while the engine core loads its model on a CPU.

The load's bulk work (the merged projections copied out of the weights' memory map, the linear
layers reordered for oneDNN, the KV pool zeroed) is page faults and memory copies, and under
`kvpilot serve` the API process loads the tokenizer on the same CPUs meanwhile. OpenMP threads
that wait at each copy's barrier for a thread the kernel has descheduled made each of those 2-5x
slower with two threads than with one on the shared 2-CPU development VM; bench/serve_startup.py's
"weights" phase went from 2.3 to 0.8 s (median of 3). The step loop keeps every thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def threads_while_loading(step_threads: int) -> int:
    """Half the step's threads, at least one: the other half is the API process's meanwhile."""
    return max(1, step_threads // 2)


@contextlib.contextmanager
def loading_threads(device: torch.device) -> Iterator[None]:
    """Within: fewer torch threads when the model loads on the CPU; the step's count after."""
    step_threads = torch.get_num_threads()
    if device.type != "cpu" or threads_while_loading(step_threads) == step_threads:
        yield
        return
    torch.set_num_threads(threads_while_loading(step_threads))
    try:
        yield
    finally:
        torch.set_num_threads(step_threads)
