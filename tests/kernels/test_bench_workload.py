"""The GPU throughput benchmark's workload generator, checked on CPU: its documented statistics hold
and it is reproducible, so figures measured later on a GPU describe the workload they claim."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench(load_bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench_module("gpu_offline_throughput")


def test_sharegpt_like_lengths(bench: ModuleType) -> None:
    inp, out = bench.sharegpt_like_lengths(1000, seed=0)
    assert len(inp) == len(out) == 1000
    assert abs(sum(inp) / 1000 - 220) < 220 * 0.02
    assert abs(sum(out) / 1000 - 185) < 185 * 0.02
    assert min(inp) >= 4 and max(inp) <= 1024 and min(out) >= 4
    assert max(i + o for i, o in zip(inp, out, strict=True)) <= 2048
    # A long tail, as ShareGPT has: the median sits well below the mean.
    assert sorted(inp)[500] < 0.8 * 220 and sorted(out)[500] < 0.8 * 185


def test_workload_is_reproducible(bench: ModuleType) -> None:
    a = bench.build_workload(50, 128256, seed=0)
    b = bench.build_workload(50, 128256, seed=0)
    c = bench.build_workload(50, 128256, seed=1)
    assert a == b and a != c
    assert [len(p) for p in a.prompts] == a.input_lens
    assert all(0 <= t < 128256 for p in a.prompts for t in p)


def test_union_length(bench: ModuleType) -> None:
    assert bench._union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert bench._union_length([]) == 0


def test_model_dir_parses_as_the_8b_shape(bench: ModuleType, tmp_path: Path) -> None:
    import json

    from kvpilot.engine.config import ModelConfig

    path = bench.write_model_dir(tmp_path)
    cfg = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (4096, 32, 32)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (8, 128, 128256)
    assert 8.0e9 < cfg.num_params < 8.1e9  # Llama-3.1-8B: 8.03 B parameters
