"""The CPU examples are sized by measurement (bench/example_memory.py; figures in
bench/RESULTS.md, "issue 13", and bench/example_memory_smollm2-cpu.json): their limit covers the
measured peak with headroom and the engine's own need, and their request covers the need too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvpilot.operator.memory import cpu_memory_need, limit_problem, request_shortfall
from kvpilot.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
MEASURED = json.loads((ROOT / "bench" / "example_memory_smollm2-cpu.json").read_text())
HEADROOM = 1.15


@pytest.mark.parametrize("example", ["smollm2-cpu.yaml", "smollm2-cpu-autoscaling.yaml"])
def test_cpu_example_limits_cover_the_measured_peak_and_the_need(example: str) -> None:
    manifest = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec = parse_spec(manifest["spec"])
    measured_args = MEASURED["args"]
    # The measurement ran this very engine config (the builder's arguments, loopback aside).
    for flag in ("--max-model-len", "--max-num-seqs", "--dtype", "--kv-cache-memory-bytes"):
        value = measured_args[measured_args.index(flag) + 1]
        assert value in str(manifest["spec"]) or str(spec.kv_cache_bytes) == value, flag
    peak = max(MEASURED["peak_sampled_rss_mib"], MEASURED["sum_of_process_peaks_mib"]) * 2**20
    assert spec.memory_limit is not None and spec.memory_limit >= HEADROOM * peak
    assert limit_problem(spec) is None and request_shortfall(spec) is None
    need = cpu_memory_need(spec)
    assert need is not None and need >= peak  # the engine's estimate is not below what was seen
    assert spec.drain_seconds >= 120
