"""The engine core's torch threads while it loads a model on a CPU: half of the step's, the
step's count back afterwards (also when the load fails)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvpilot.engine.core.load_threads import loading_threads, threads_while_loading


@pytest.fixture
def four_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_half_the_threads_at_least_one() -> None:
    assert threads_while_loading(1) == 1
    assert threads_while_loading(2) == 1
    assert threads_while_loading(3) == 1
    assert threads_while_loading(16) == 8


def test_a_cpu_load_runs_on_half_and_the_steps_get_all_back(four_threads: None) -> None:
    with loading_threads(torch.device("cpu")):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 4


def test_a_failed_load_gives_the_threads_back(four_threads: None) -> None:
    with pytest.raises(RuntimeError, match="bad weights"), loading_threads(torch.device("cpu")):
        raise RuntimeError("bad weights")
    assert torch.get_num_threads() == 4


def test_a_load_off_the_cpu_keeps_the_host_threads(four_threads: None) -> None:
    with loading_threads(torch.device("meta")):
        assert torch.get_num_threads() == 4
