"""bench/step_timeline.py, checked on CPU: the per-step records of a real engine run account for
every token the run computed, respect the scheduler's limits, and leave the runner as it was; the
summary partitions the steps and their time by batch size. (The device spans come from CUDA events
and are measured on a GPU; here they are zero, or set by hand for the summary.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.kernels.workloads import TINY_LLAMA


@pytest.fixture(scope="module")
def timeline(load_bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench_module("step_timeline")


@pytest.fixture(scope="module")
def offline(load_bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench_module("gpu_offline_throughput")


@pytest.fixture(scope="module")
def tiny_llama() -> dict[str, Any]:
    return dict(TINY_LLAMA)


def tiny_llm(tmp_path: Path, config: dict[str, Any]) -> Any:
    from kvpilot.engine import LLM

    (tmp_path / "config.json").write_text(json.dumps(config))
    return LLM(
        model=str(tmp_path),
        load_format="dummy",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
    )


def test_records_account_for_every_computed_token(
    timeline: ModuleType, tiny_llama: dict[str, Any], tmp_path: Path
) -> None:
    from kvpilot.engine import SamplingParams

    llm = tiny_llm(tmp_path, tiny_llama)
    prompt_lens = [5, 40, 100, 7, 63, 16, 30, 90, 12, 45, 3, 70]
    output_lens = [9, 30, 4, 50, 12, 25, 3, 18, 40, 6, 22, 11]
    prompts = [[(7 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate(prompt_lens)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    runner = llm.engine.core.runner
    with timeline.StepTimeline(runner, cuda_events=False) as recorder:
        outputs = llm.generate(prompts, params)
    assert "launch" not in vars(runner)  # the wrapper is gone
    assert [len(o.outputs[0].token_ids) for o in outputs] == output_lens
    records = recorder.records
    # Every prompt token is computed once (no prefix shared, no preemption at this size), and
    # every output token but the last is fed back as one decode row.
    assert sum(r.prefill_tokens for r in records) == sum(prompt_lens)
    assert sum(r.decode_rows for r in records) == sum(output_lens) - len(output_lens)
    assert max(r.seqs for r in records) == 8
    assert all(r.decode_rows + r.prefill_tokens <= 64 for r in records)
    assert all(r.decode_rows <= r.seqs and r.context_tokens >= r.seqs for r in records)
    assert not any(r.graphed for r in records)  # CPU: no CUDA graphs
    starts = [r.host_start_s for r in records]
    assert starts == sorted(starts) and all(r.host_launch_ms > 0 for r in records)
    # The longest request (50 outputs after a 7-token prompt) decodes alone at the end.
    assert records[-1].seqs == 1 and records[-1].context_tokens == 7 + 50 - 1

    summary = timeline.summarize(records, bins=(1, 4, 8, 10**9))
    assert sum(row["steps"] for row in summary["bins"]) == len(records) == summary["steps"]
    assert [row["seqs"] for row in summary["bins"]] == ["1-3", "4-7", ">=8"]
    assert sum(row["decode_tokens"] for row in summary["bins"]) == sum(output_lens) - 12
    assert timeline.from_json(timeline.to_json(records))[5].seqs == records[5].seqs


def test_summary_shares_of_device_time(timeline: ModuleType) -> None:
    def record(seqs: int, span: float, gap: float, graphed: bool = True) -> object:
        return timeline.StepRecord(seqs, seqs, 0, 10 * seqs, graphed, 0.0, 0.5, span, gap)

    records = [record(1, 4.0, 1.0), record(2, 5.0, 0.0), record(300, 30.0, 0.0, graphed=False)]
    summary = timeline.summarize(records, bins=(1, 16, 10**9))
    assert summary["device_time_ms"] == 40.0 and summary["gap_ms"] == 1.0
    tail, full = summary["bins"]
    assert (tail["seqs"], tail["steps"], tail["ms_per_step"]) == ("1-15", 2, 5.0)
    assert tail["share_of_device_time"] == pytest.approx(0.25)
    assert (full["seqs"], full["graphed_steps"], full["share_of_device_time"]) == (">=16", 0, 0.75)
    text = timeline.format_summary(summary)
    assert "3 steps" in text and "25.0%" in text and "75.0%" in text


def test_each_benchmark_part_computes_every_prompt(
    timeline: ModuleType, offline: ModuleType, tiny_llama: dict[str, Any], tmp_path: Path
) -> None:
    """The GPU benchmark's parts run the same prompts one after another: each must prefill them
    all again, not find them in the prefix cache the part before left."""
    from kvpilot.engine import SamplingParams

    llm = tiny_llm(tmp_path, tiny_llama)
    prompts = [[(11 * i + j) % 500 + 1 for j in range(48)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def prefill_tokens(forget: bool) -> int:
        if forget:
            offline.forget_cached_prompts(llm)
        with timeline.StepTimeline(llm.engine.core.runner, cuda_events=False) as recorder:
            llm.generate(prompts, params)
        return sum(r.prefill_tokens for r in recorder.records)

    assert prefill_tokens(forget=True) == 6 * 48
    assert prefill_tokens(forget=False) < 6 * 48  # what a later part would have measured
    assert prefill_tokens(forget=True) == 6 * 48


def test_floor_of_a_schedule(timeline: ModuleType) -> None:
    """Each step's floor: the weights' read or its tokens at the largest steps' rate per token,
    whichever is longer, plus its keys and values read."""

    def record(seqs: int, prefill: int, context: int, span: float) -> object:
        return timeline.StepRecord(seqs, seqs, prefill, context, True, 0.0, 1.0, span, 0.0)

    # Weights: 4 bytes at 2 bytes/s = 2 s a step; KV: 1 byte per context token.
    big = record(1, 4999, 100, 5000.0)  # 5000 tokens in 5 s: 1 ms per token
    small = record(2, 0, 20, 3000.0)
    found = timeline.floor_ms([big, small], 4.0, 2.0, 1.0, large_step_tokens=4096)
    assert found["us_per_token_of_large_steps"] == pytest.approx(1000.0)
    assert found["measured_s"] == pytest.approx(8.0)
    # big: max(2, 5000 * 0.001) + 100 / 2 = 55; small: max(2, 0.002) + 20 / 2 = 12
    assert found["floor_s"] == pytest.approx(67.0)
    assert [row["seqs"] for row in found["bins"]] == ["1-15"]
    with pytest.raises(ValueError, match="no step of 4096"):
        timeline.floor_ms([small], 4.0, 2.0, 1.0)
