"""The engine keeps the heap memory a step frees (engine/cpu/heap.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvpilot.engine.cpu.heap import load_glibc, retain_freed_memory, user_chose_malloc

# A step's pattern in small: several large tensors live at once, then all freed, over and over.
# Prints the minor page faults of the last 5 steps, once the heap has grown to what steps need.
STEPS = textwrap.dedent(
    """
    import resource, sys, torch
    if sys.argv[1] == "retain":
        from kvpilot.engine.cpu.heap import retain_freed_memory
        assert retain_freed_memory({})
    def step():
        live = [torch.ones(5 * 2**20) for _ in range(4)]  # 4 x 20 MiB
        del live
    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)

needs_glibc = pytest.mark.skipif(load_glibc() is None, reason="glibc's mallopt: not this libc")


def step_faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@needs_glibc
def test_retained_memory_is_not_faulted_in_again() -> None:
    # 5 steps x 80 MiB is 102,400 pages. glibc's own thresholds gave them all back to the kernel,
    # and faulted all 102,400 in again, in 3 of 4 runs of this pattern on the CI machine (which
    # runs do depends on the address-space layout, so the default is not asserted).
    assert step_faults("retain") < 1_000


def test_the_users_malloc_environment_wins() -> None:
    assert user_chose_malloc({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert user_chose_malloc({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert user_chose_malloc({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert not user_chose_malloc({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1"})
    assert not user_chose_malloc({"MALLOC_TRIM_THRESHOLD_": ""})
    assert not retain_freed_memory({"MALLOC_TOP_PAD_": "0"})
