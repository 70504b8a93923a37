"""torch's intra-op threads fitted to a cgroup CPU quota (v1 and v2 layouts in a temp dir)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpilot.engine.cpu import threads


def test_cgroup_v2_cpu_max() -> None:
    assert threads.cpu_limit_v2("max 100000\n") is None
    assert threads.cpu_limit_v2("400000 100000\n") == 4.0
    assert threads.cpu_limit_v2("150000 100000") == 1.5
    assert threads.cpu_limit_v2("garbage") is None


def test_cgroup_v1_cfs_quota() -> None:
    assert threads.cpu_limit_v1("-1\n", "100000\n") is None
    assert threads.cpu_limit_v1("250000\n", "100000\n") == 2.5
    assert threads.cpu_limit_v1("50000", "100000") == 0.5


def test_threads_for_a_limit() -> None:
    assert threads.threads_for_limit(64, None) == 64
    assert threads.threads_for_limit(64, 4.0) == 4
    assert threads.threads_for_limit(64, 1.5) == 1  # a whole CPU each; the rest for HTTP
    assert threads.threads_for_limit(64, 0.5) == 1
    assert threads.threads_for_limit(2, 8.0) == 2  # never more than torch already runs


def test_reads_v2_then_v1_layouts(tmp_path: Path) -> None:
    assert threads.read_cpu_limit(tmp_path) is None  # no cgroup files: no quota
    v1 = tmp_path / "v1" / "cpu,cpuacct"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.read_cpu_limit(tmp_path / "v1") == 3.0
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("200000 100000\n")
    assert threads.read_cpu_limit(v2) == 2.0
    (v2 / "cpu.max").write_text("not numbers\n")
    assert threads.read_cpu_limit(v2) is None  # unreadable: left alone, not a crash


@pytest.fixture
def restore_threads() -> Iterator[int]:
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_serve_fits_torch_threads_to_the_quota(
    tmp_path: Path, restore_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(4)
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert threads.fit_threads_to_cpu_quota(tmp_path) == 2
    assert torch.get_num_threads() == 2
    # Unlimited, or already within the quota: nothing changes.
    assert threads.fit_threads_to_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.fit_threads_to_cpu_quota(tmp_path) is None
    assert torch.get_num_threads() == 2


def test_omp_num_threads_wins(
    tmp_path: Path, restore_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert threads.fit_threads_to_cpu_quota(tmp_path) is None
    assert torch.get_num_threads() == 3
