"""How many KV blocks a budget holds, and the pool's layout: pure arithmetic, checked exactly."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.config import CacheConfig, ModelConfig
from kvpilot.engine.kv_cache.budget import (
    DraftReserve,
    decide_num_blocks,
    kv_bytes_per_block,
    num_blocks_beside_draft,
    num_blocks_in_budget,
)
from kvpilot.engine.kv_cache.pool import KVLayout, PagedKVPool

CPU = torch.device("cpu")


def test_a_block_is_k_and_v_of_every_layer_for_block_size_tokens() -> None:
    cfg = ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
        tie_word_embeddings=False, attention_bias=False,
    )  # fmt: skip
    per_block = kv_bytes_per_block(
        num_layers=3, num_kv_heads=2, head_dim=cfg.head_dim, block_size=16, itemsize=2
    )
    assert per_block == cfg.kv_bytes_per_token * 2 * 16 == 2 * 3 * 2 * 8 * 2 * 16


def test_a_cpu_budget_counts_each_block_once_per_rank_a_gpu_budget_per_gpu() -> None:
    assert num_blocks_in_budget(10_000, 100, on_gpu=False, num_ranks=1) == 100
    assert num_blocks_in_budget(10_000, 100, on_gpu=False, num_ranks=4) == 25
    assert num_blocks_in_budget(10_000, 100, on_gpu=True, num_ranks=4) == 100
    assert num_blocks_in_budget(99, 100, on_gpu=False, num_ranks=1) == 0


def test_the_override_wins_and_a_budget_without_one_block_is_refused() -> None:
    assert decide_num_blocks(CacheConfig(num_blocks=7, kv_cache_bytes=1), CPU, 100, None) == 7
    assert decide_num_blocks(CacheConfig(kv_cache_bytes=1000), CPU, 100, None) == 10
    with pytest.raises(ValueError, match="no room for the KV cache"):
        decide_num_blocks(CacheConfig(kv_cache_bytes=99), CPU, 100, None)


@pytest.mark.parametrize("with_null_block", (False, True))
def test_the_pool_holds_k_and_v_per_layer_and_the_null_block_past_the_managers(
    with_null_block: bool,
) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, block_size=8)
    pool = PagedKVPool(layout, 5, torch.bfloat16, CPU, with_null_block=with_null_block)
    assert len(pool.layers) == 2
    rows = 6 if with_null_block else 5
    for k, v in pool.layers:
        assert k.shape == v.shape == (rows, 8, 3, 4) and k.dtype == torch.bfloat16
    assert pool.null_block == (5 if with_null_block else None)
    assert pool.bytes_per_block == 2 * 2 * 3 * 4 * 2 * 8


def test_the_targets_blocks_beside_a_draft_are_the_most_that_fit_with_it() -> None:
    """On a GPU the draft (weights, and a pool as large as the target's up to max_kv_tokens)
    loads after the target's pool: the target takes the most blocks that leave it room."""
    bytes_per_block, block_size = 1000, 16
    draft = DraftReserve(weight_bytes=5000, kv_bytes_per_token=10, max_kv_tokens=20 * 16)

    def used(num_blocks: int) -> int:
        draft_tokens = min(num_blocks * block_size, draft.max_kv_tokens)
        return num_blocks * bytes_per_block + draft.weight_bytes + draft_tokens * 10

    for budget in [0, 4999, 5000, 6160, 6161, 30_000, 5000 + 20 * 1160, 60_000, 10**6]:
        n = num_blocks_beside_draft(budget, bytes_per_block, block_size, draft)
        assert n == 0 or used(n) <= budget, budget
        assert used(n + 1) > budget, budget
    # Past max_kv_tokens the draft's pool no longer grows: the rest is the target's alone.
    assert (
        num_blocks_beside_draft(10**6, bytes_per_block, block_size, draft)
        == (10**6 - 5000 - 320 * 10) // 1000
    )


def test_a_cpu_budget_ignores_the_draft() -> None:
    """On CPU the KV budget is the target's; the memory check counts the draft beside it."""
    draft = DraftReserve(weight_bytes=10**9, kv_bytes_per_token=10, max_kv_tokens=16)
    cache = CacheConfig(kv_cache_bytes=10 * 4096)
    assert decide_num_blocks(cache, CPU, 4096, None, draft) == 10
