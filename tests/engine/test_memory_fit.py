"""The start-up memory check: the cgroup limit read from v2 and v1 trees, the need of a config,
and a real `kvpilot serve` that refuses to start, with the figures, instead of being OOM-killed."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvpilot.contract.engine_choices import DTYPE_NAMES
from kvpilot.contract.engine_defaults import DTYPE_ITEMSIZE
from kvpilot.contract.sizing import MemoryNeed
from kvpilot.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvpilot.engine.core.engine_core import cpu_memory_need
from kvpilot.engine.memory_fit import (
    MemoryFitError,
    check_memory_fit,
    container_memory_limit,
    memory_limit,
)


def tree(tmp_path: Path, files: dict[str, str], cgroup: str) -> int | None:
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "cgroup").write_text(cgroup)
    return container_memory_limit(tmp_path / "fs", tmp_path / "cgroup")


def test_cgroup_v2_limit_is_the_smallest_on_the_way_up(tmp_path: Path) -> None:
    files = {"kubepods/pod1/memory.max": "max\n", "kubepods/memory.max": "2147483648\n"}
    assert tree(tmp_path, files, "0::/kubepods/pod1\n") == 2**31


def test_cgroup_v2_inside_a_container_namespace(tmp_path: Path) -> None:
    assert tree(tmp_path, {"memory.max": "1073741824\n"}, "0::/\n") == 2**30


def test_cgroup_v1_limit_and_v1_unlimited(tmp_path: Path) -> None:
    limited = {"memory/docker/abc/memory.limit_in_bytes": "536870912\n"}
    assert tree(tmp_path, limited, "4:memory:/docker/abc\n0::/\n") == 2**29
    unlimited = {"memory/memory.limit_in_bytes": "9223372036854771712\n"}
    assert tree(tmp_path / "u", unlimited, "4:cpu,memory:/\n") is None


def test_no_cgroup_filesystem_means_no_limit(tmp_path: Path) -> None:
    assert container_memory_limit(tmp_path, tmp_path / "missing") is None
    assert memory_limit({"KVPILOT_MEMORY_LIMIT_BYTES": "1000"}) == 1000


def test_check_names_every_part_and_passes_what_fits() -> None:
    need = MemoryNeed(weights=2**30, kv_cache=2**30, working=2**29)
    check_memory_fit(need, None)
    check_memory_fit(need, need.total)
    with pytest.raises(MemoryFitError) as caught:
        check_memory_fit(need, need.total - 1)
    message = str(caught.value)
    for part in ("2.50 GiB", "weights 1.00", "KV cache 1.00", "working memory 0.50"):
        assert part in message


SMOLLM2 = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=8192,
    tie_word_embeddings=True, attention_bias=False,
)  # fmt: skip


def test_the_need_follows_dtype_and_kv_budget() -> None:
    fp32 = cpu_memory_need(
        EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_bytes=3 * 2**20)), SMOLLM2
    )
    assert fp32.weights == SMOLLM2.num_params * 4 and fp32.kv_cache == 3 * 2**20
    bf16 = cpu_memory_need(
        EngineConfig(dtype="bfloat16", scheduler=SchedulerConfig(max_num_batched_tokens=512)),
        SMOLLM2,
    )
    assert bf16.weights == SMOLLM2.num_params * 2 and bf16.kv_cache == 2**30
    assert bf16.working < fp32.working  # fewer, smaller activations
    blocks = cpu_memory_need(EngineConfig(cache=CacheConfig(num_blocks=10)), SMOLLM2)
    assert blocks.kv_cache == 10 * 16 * SMOLLM2.kv_bytes_per_token * 4


def test_an_fp8_cache_of_num_blocks_counts_one_byte_an_element() -> None:
    config = EngineConfig(cache=CacheConfig(num_blocks=10, kv_cache_dtype="fp8"))
    assert cpu_memory_need(config, SMOLLM2).kv_cache == 10 * 16 * SMOLLM2.kv_bytes_per_token


DRAFT = "builtin://smollm2-135m-instruct"  # the bundled model as its own draft


@pytest.mark.parametrize(
    ("budget_tokens", "max_model_len", "max_speculating", "draft_tokens"),
    [
        # The target's pool is the bound: the draft's pool holds as many tokens.
        (1000 * 16, None, 8, 1000 * 16),
        # disable_by_batch_size sequences of max_model_len are fewer: 2 x 300 in whole blocks.
        (1000 * 16, 300, 2, 38 * 16),
        # The longest sequence is the target's pool itself (below max_model_len): 40 blocks.
        (40 * 16 + 5, None, 8, 40 * 16),
    ],
)
def test_a_draft_models_weights_and_kv_cache_are_in_the_need(
    budget_tokens: int, max_model_len: int | None, max_speculating: int, draft_tokens: int
) -> None:
    per_token = SMOLLM2.kv_bytes_per_token * 4  # float32
    spec = SpeculativeConfig(model=DRAFT, disable_by_batch_size=max_speculating)
    config = EngineConfig(
        dtype="float32",
        max_model_len=max_model_len,
        cache=CacheConfig(kv_cache_bytes=budget_tokens * per_token),
        speculative=spec,
    )
    need = cpu_memory_need(config, SMOLLM2)
    without = cpu_memory_need(dataclasses.replace(config, speculative=None), SMOLLM2)
    assert need.draft == SMOLLM2.num_params * 4 + draft_tokens * per_token
    assert need.total == without.total + need.draft and without.draft == 0
    # n-gram speculation holds no model.
    ngram = dataclasses.replace(config, speculative=SpeculativeConfig(method="ngram"))
    assert cpu_memory_need(ngram, SMOLLM2).total == without.total


def test_the_refusal_names_the_draft_model() -> None:
    need = MemoryNeed(weights=2**30, kv_cache=2**30, working=2**29, draft=2**29)
    with pytest.raises(MemoryFitError, match=r"needs about 3\.00 GiB.*draft model .* 0\.50 GiB"):
        check_memory_fit(need, need.total - 1)


def test_the_contracts_itemsizes_are_torchs() -> None:
    """The operator sizes pods with the contract's table; the engine with torch's dtypes."""
    assert set(DTYPE_ITEMSIZE) == set(DTYPE_NAMES)
    for name, itemsize in DTYPE_ITEMSIZE.items():
        assert torch.empty((), dtype=getattr(torch, name)).element_size() == itemsize


def test_serve_refuses_to_start_over_its_memory_limit() -> None:
    """A real `kvpilot serve` under a 1 GiB limit with a 2 GiB KV budget: exit 1 with the
    figures, before the KV cache (or the weights) are allocated."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "serve", "--port", "0", "--kv-cache-gib", "2"],
        env={**os.environ, "KVPILOT_MEMORY_LIMIT_BYTES": str(2**30)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "container's memory limit is 1.00 GiB" in proc.stderr, proc.stderr[-3000:]
    assert "KV cache 2.00 GiB" in proc.stderr
    assert "KV cache:" not in proc.stderr  # the runner's allocation log line never came
    assert time.monotonic() - started < 180


def test_an_explicit_kv_budget_sizes_the_pool() -> None:
    """kv_cache_bytes (the CRD's kvCacheBytes, `--kv-cache-memory-bytes`) gives the pool as many
    blocks as fit, as kv_cache_gib does: the example InferenceService sets it."""
    from kvpilot.engine import LLM, SamplingParams

    budget = 24 * 2**20
    llm = LLM(dtype="float32", kv_cache_bytes=budget, block_size=16)
    runner = llm.engine.runner
    assert runner.num_blocks == budget // runner.bytes_per_block > 0
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
