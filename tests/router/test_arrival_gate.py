"""router/arrival_gate.py: arrivals get their turns one per pass of the event loop, the best
class first, and a cancelled waiter holds nobody up."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kvpilot.router.arrival_gate import ArrivalGate


async def test_a_better_class_arriving_mid_burst_goes_next() -> None:
    gate = ArrivalGate()
    order: list[str] = []

    async def arrival(name: str, rank: int) -> None:
        await gate.turn(rank)
        order.append(name)

    burst = [asyncio.create_task(arrival(f"batch-{i}", 3)) for i in range(20)]
    while len(order) < 2:  # the burst has started taking its turns
        await asyncio.sleep(0)
    premium = asyncio.create_task(arrival("premium", 0))
    await asyncio.gather(premium, *burst)
    # Two burst arrivals had their turns before it was created and two more while its task
    # reached the gate; it overtook the other 16.
    assert order.index("premium") == 4
    assert [n for n in order if n != "premium"] == [f"batch-{i}" for i in range(20)]


async def test_turns_are_one_per_pass_of_the_loop() -> None:
    gate = ArrivalGate()
    passes = 0
    turns_at: list[int] = []

    async def count_passes() -> None:
        nonlocal passes
        while True:
            await asyncio.sleep(0)
            passes += 1

    counter = asyncio.create_task(count_passes())

    async def arrival() -> None:
        await gate.turn(1)
        turns_at.append(passes)

    await asyncio.gather(*(arrival() for _ in range(5)))
    counter.cancel()
    # Each turn came on a later pass than the one before it: the loop polled in between.
    assert all(b > a for a, b in itertools.pairwise(turns_at))
    assert gate.num_waiting == 0


async def test_a_cancelled_waiter_gives_its_turn_to_the_next() -> None:
    gate = ArrivalGate()
    served: list[int] = []

    async def arrival(i: int) -> None:
        await gate.turn(2)
        served.append(i)

    tasks = [asyncio.create_task(arrival(i)) for i in range(4)]
    await asyncio.sleep(0)  # all four waiting
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert served == [0, 2, 3]
    # The gate is idle again and gives a new arrival its turn at once.
    await asyncio.wait_for(gate.turn(5), timeout=1)


async def test_an_arrival_without_contention_loses_no_pass_of_the_loop() -> None:
    gate = ArrivalGate()
    first = gate.turn(1)
    with pytest.raises(StopIteration):  # done without suspending: no pass of the loop lost
        first.send(None)
    # A second arrival in the same pass waits for a later one.
    second = gate.turn(0)
    second.send(None)  # suspended on its turn
    second.close()
