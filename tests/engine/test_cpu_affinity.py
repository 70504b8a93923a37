"""--engine-cpus / --api-cpus: CPU lists read and written, placed among the CPUs this process may
use (and its CPU quota), and a whole process (every thread, not only the caller) bound to them."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvpilot.contract.cpus import format_cpu_list, parse_cpu_list
from kvpilot.engine.cpu.affinity import CpuPlacement, bind_this_process, place


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", (0,)),
        ("0-3", (0, 1, 2, 3)),
        ("0-3,6", (0, 1, 2, 3, 6)),
        (" 6, 1-2 ,2", (1, 2, 6)),  # sorted, each once, spaces as taskset takes them
        ("5-5", (5,)),
    ],
)
def test_cpu_lists_parse_sorted_and_each_cpu_once(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "'' is not a CPU number or range"),
        ("a-b", "'a-b' is not a CPU number or range"),
        ("1,,2", "'' is not a CPU number or range"),
        ("3-1", "'3-1': a range goes from low to high"),
        ("-1", "'-1' is not a CPU number or range"),
        ("0-99999", "CPU numbers are at most 16383"),
    ],
)
def test_a_bad_cpu_list_says_why(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_cpu_list(text)
    assert message in str(caught.value)


def test_format_cpu_list_writes_ranges() -> None:
    assert format_cpu_list({5, 0, 2, 1}) == "0-2,5"
    assert format_cpu_list([7]) == "7"
    assert format_cpu_list(range(8)) == "0-7"


def test_no_flag_no_placement() -> None:
    assert place(range(8), None, {}) is None


def test_engine_cpus_bind_the_engine_there_and_the_api_process_to_the_rest() -> None:
    placement = place(range(8), None, {}, engine_cpus=(0, 1, 2))
    assert placement == CpuPlacement(engine=(0, 1, 2), api=(3, 4, 5, 6, 7), engine_threads=3)
    assert placement.describe() == (
        "engine core on CPUs 0-2, 3 intra-op threads; API process on 3-7"
    )
    # Every CPU for the engine: the API process shares them (not bound), as without the flag.
    every = place({0, 1}, None, {}, engine_cpus=(0, 1))
    assert every is not None and every.api is None
    assert "API process on the same CPUs" in every.describe()


def test_api_cpus_leave_the_last_cpus_to_the_api_process() -> None:
    # A pod's cpuset: CPUs it cannot know in advance (here 12-15).
    assert place({12, 13, 14, 15}, 4.0, {}, api_cpus=1) == CpuPlacement(
        engine=(12, 13, 14), api=(15,), engine_threads=3
    )
    assert place({0, 1}, None, {}, api_cpus=1) == CpuPlacement(
        engine=(0,), api=(1,), engine_threads=1
    )


def test_under_a_quota_alone_api_cpus_take_threads_not_cpus() -> None:
    """A CPU limit without a cpuset (64 CPUs visible, 4.5 allowed by the CFS quota): nothing to
    bind; the engine core takes the quota's whole CPUs less the API's."""
    placement = place(range(64), 4.5, {}, api_cpus=1)
    assert placement == CpuPlacement(engine=None, api=None, engine_threads=3)
    assert placement.describe() == (
        "engine core: 3 intra-op threads (under a CPU quota: no CPUs of its own to bind)"
    )
    # Explicit CPUs under a smaller quota: bound, and no more threads than the quota's CPUs.
    assert place(range(64), 2.0, {}, engine_cpus=(0, 1, 2, 3)) == CpuPlacement(
        engine=(0, 1, 2, 3), api=tuple(range(4, 64)), engine_threads=2
    )


def test_omp_num_threads_sets_the_engine_threads() -> None:
    omp = {"OMP_NUM_THREADS": "1"}
    explicit = place(range(8), None, omp, engine_cpus=(0, 1, 2))
    quota_only = place(range(64), 8.0, omp, api_cpus=2)
    assert explicit is not None and explicit.engine_threads == 1
    assert quota_only is not None and quota_only.engine_threads == 1
    for unset in ("", "0", "many"):  # not a count: one thread per CPU
        placement = place(range(8), None, {"OMP_NUM_THREADS": unset}, engine_cpus=(0, 1, 2))
        assert placement is not None and placement.engine_threads == 3


@pytest.mark.parametrize(
    ("allowed", "quota", "flags", "message"),
    [
        (
            {0, 1, 2},
            None,
            {"engine_cpus": (2, 3, 4)},
            "--engine-cpus 2-4: CPU(s) 3-4 are not among this process's CPUs 0-2",
        ),
        ({0, 1}, None, {"engine_cpus": ()}, "--engine-cpus names no CPU"),
        (
            {0, 1},
            None,
            {"api_cpus": 2},
            "--api-cpus 2 leaves the engine core no CPU: this process may use 2 CPU(s), 0-1",
        ),
        (
            range(64),
            2.0,
            {"api_cpus": 2},
            "--api-cpus 2 leaves the engine core no CPU: this process's CPU quota is 2 CPUs",
        ),
        ({0, 1}, None, {"api_cpus": 0}, "--api-cpus must be >= 1, got 0"),
        (
            {0, 1},
            None,
            {"api_cpus": 1, "engine_cpus": (0,)},
            "give --engine-cpus or --api-cpus, not both",
        ),
    ],
)
def test_a_placement_the_cpus_cannot_hold_is_refused_with_them(
    allowed: set[int], quota: float | None, flags: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        place(allowed, quota, {}, **flags)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_binding_the_process_binds_every_thread_it_has() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("binding to a subset needs two CPUs; this process may use one")
    one = min(allowed)
    started, stop = threading.Event(), threading.Event()

    def waiter() -> None:
        started.set()
        stop.wait()

    other = threading.Thread(target=waiter)
    other.start()
    started.wait()
    tasks = Path("/proc/self/task")
    try:
        assert bind_this_process({one}) >= 2
        masks = {int(t.name): os.sched_getaffinity(int(t.name)) for t in tasks.iterdir()}
        assert other.native_id in masks and all(m == {one} for m in masks.values()), masks
        # A thread started now inherits the mask of the thread that starts it.
        seen: list[set[int]] = []
        later = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        later.start()
        later.join()
        assert seen == [{one}]
    finally:
        bind_this_process(allowed)
        stop.set()
        other.join()
    assert os.sched_getaffinity(0) == allowed
