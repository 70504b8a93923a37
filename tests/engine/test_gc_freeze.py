"""Startup objects are moved out of the collector's sight, and only those: what serving allocates
afterwards is still collected."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvpilot.engine.gc_freeze import freeze_startup_objects


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()


def tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_startup_objects_frozen_and_later_garbage_still_collected(unfrozen_after: None) -> None:
    kept = {"startup": [1, 2, 3]}
    assert tracked(kept)
    frozen = freeze_startup_objects("test")
    # A frozen object still dies when its last reference goes (another test's thread may drop
    # one at any moment), so the count can only have fallen since the freeze, never risen.
    assert 0 < gc.get_freeze_count() <= frozen.objects
    assert frozen.objects > 1000, "startup's imports are frozen, not just this test's dict"
    assert not tracked(kept), "a frozen object is left out of every generation"

    class Cycle:
        pass

    cycle = Cycle()
    cycle.me = cycle  # type: ignore[attr-defined]
    assert tracked(cycle)
    del cycle
    assert gc.collect() >= 1, "garbage made after the freeze is still collected"
