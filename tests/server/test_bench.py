"""bench/serve_bench.py: dataset, arrivals and statistics, and one tiny run on the real server."""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvpilot.engine.server.inprocess import InProcessServer

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve_bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serve_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_dataset_is_seeded_and_within_the_documented_ranges(bench: ModuleType) -> None:
    a = bench.synthetic_dataset(200, 100, 20, 0.5, 30, seed=7)
    assert a == bench.synthetic_dataset(200, 100, 20, 0.5, 30, seed=7)
    assert a != bench.synthetic_dataset(200, 100, 20, 0.5, 30, seed=8)
    assert all(50 <= r.input_len <= 150 and 10 <= r.output_len <= 30 for r in a)
    assert all(len(r.text.split()) == r.input_len for r in a)
    assert len({r.prefix for r in a}) == 1 and len(a[0].prefix.split()) == 30
    assert abs(statistics.fmean(r.input_len for r in a) - 100) < 8


def test_poisson_arrivals_have_the_requested_rate(bench: ModuleType) -> None:
    offsets = bench.arrival_offsets(4000, 5.0, seed=0)
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert abs(len(offsets) / offsets[-1] - 5.0) < 0.3
    assert bench.arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_percentiles_interpolate_like_numpy(bench: ModuleType) -> None:
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([5.0], 99) == 5.0
    assert bench.percentile(list(range(101)), 99) == 99.0


async def test_a_tiny_run_against_the_real_server(
    bench: ModuleType, server: InProcessServer
) -> None:
    requests = bench.synthetic_dataset(4, 8, 4, 0.5, 0, seed=1)
    for endpoint in ("completions", "chat"):
        run = await bench.run_workload(
            server.url, endpoint, requests, 50.0, 2, seed=1, show_progress=False
        )
        s = run.report()["summary"]
        assert s["completed"] == 4 and s["failed"] == 0
        assert s["total_output_tokens"] == sum(r.output_len for r in requests)
        assert s["ttft_ms"]["p50"] > 0 and s["e2e_ms"]["p99"] >= s["ttft_ms"]["p99"]
        assert s["request_throughput"] > 0
        assert s["server_metrics_delta"]["vllm:generation_tokens_total"] == s["total_output_tokens"]
