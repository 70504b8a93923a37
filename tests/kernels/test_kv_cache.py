"""The KV-write kernel copies bits: it must match the torch reference exactly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvpilot.engine.attention.torch_ref import write_kv_reference
from kvpilot.engine.kernels.kv_cache import write_kv


def prepare_write(
    num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(num_tokens * 7 + block_size)
    num_blocks = -(-num_tokens // block_size) + 4
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Distinct random slots anywhere in the pool, as scattered sequences produce.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("block_size", (16, 32, 64))
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), ((1, 64), (3, 64), (8, 128)))
def test_write_matches_reference_exactly(
    num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    num_tokens = 19
    key, value, k_cache, v_cache, slots = prepare_write(
        num_tokens, num_kv_heads, head_dim, block_size, dtype
    )
    assert slots.max() >= block_size  # several blocks are written, not just the first
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, k_ref, v_ref, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_int32_slots_strided_keys_and_dtype_cast() -> None:
    key, value, k_cache, v_cache, slots = prepare_write(20, 2, 64, 16, torch.float32)
    # Keys as the model produces them: a slice of the fused qkv output; the cache in float16.
    qkv = torch.randn(20, 6, 64)
    qkv[:, 2:4] = key
    k_cache, v_cache = k_cache.half(), v_cache.half()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, k_ref, v_ref, slots)
    write_kv(qkv[:, 2:4], value, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_rejects_mismatched_inputs() -> None:
    key, value, k_cache, v_cache, slots = prepare_write(4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="caches must be"):
        write_kv(key, value, k_cache[:, :, :1], v_cache[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, value, k_cache, v_cache, slots[:3])
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="agree in dtype"):
        write_kv(key, value.half(), k_cache, v_cache, slots)


def test_backend_writes_through_kernel(paged_batch: Callable[..., object]) -> None:
    from kvpilot.engine.kernels.attention_backend import TritonAttentionBackend

    key, value, k_cache, v_cache, slots = prepare_write(9, 2, 64, 16, torch.bfloat16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, k_ref, v_ref, slots)
    TritonAttentionBackend().write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
