"""The C elementwise steps against the torch versions they replace: identical results, since both
compute in float32 and round to the storage dtype at the same points."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.attention.torch_ref import write_kv_reference
from kvpilot.engine.config import RopeScaling
from kvpilot.engine.cpu import layer_ops
from kvpilot.engine.cpu.build import load_library
from kvpilot.engine.model import layers

LIB = load_library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler to build the CPU kernels")
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32)])
def test_rotary_on_qkv_views(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """q and k as the model passes them: strided views into one merged qkv projection."""
    num_tokens = 37
    gen = torch.Generator().manual_seed(0)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen)
    cache = layers.rope_cos_sin_cache(
        head_dim, 4096, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    )
    q_out, k_out = layer_ops.apply_rotary(LIB, q, k, positions, cache)
    q_ref, k_ref = layers.apply_rotary(q, k, positions, cache)
    assert_matches(q_out, q_ref)
    assert_matches(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, kvh, head_dim = 11, 3, 64
    qkv = torch.randn(num_tokens, 9 * 64 + 2 * kvh * head_dim, generator=gen).to(dtype)
    _, key, value = qkv.split([9 * 64, kvh * head_dim, kvh * head_dim], dim=-1)
    key = key.view(num_tokens, kvh, head_dim)
    value = value.view(num_tokens, kvh, head_dim)
    slots = torch.randperm(8 * 16, generator=gen)[:num_tokens]
    caches = [torch.zeros(8, 16, kvh, head_dim, dtype=dtype) for _ in range(4)]
    layer_ops.write_kv(LIB, key, value, caches[0], caches[1], slots)
    write_kv_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].count_nonzero() == num_tokens * kvh * head_dim


def test_write_kv_slots_outside_the_cache_raise_before_writing() -> None:
    key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    k_cache, v_cache = torch.zeros(4, 8, 2, 32), torch.zeros(4, 8, 2, 32)
    for bad in (-1, 32):
        with pytest.raises(IndexError, match="outside the cache's 32 slots"):
            layer_ops.write_kv(LIB, key, value, k_cache, v_cache, torch.tensor([5, bad, 6]))
        assert k_cache.count_nonzero() == 0 and v_cache.count_nonzero() == 0


def test_inconsistent_shapes_go_to_the_reference() -> None:
    """The C kernels trust their shapes; the torch versions reject what does not fit."""
    cache = torch.zeros(4, 8, 2, 32)
    key = torch.randn(3, 2, 32)
    for value, slots in ((torch.randn(2, 2, 32), torch.arange(3)), (key, torch.arange(2))):
        with pytest.raises((IndexError, RuntimeError)):
            layer_ops.write_kv(LIB, key, value, cache, cache.clone(), slots)
    q, k = torch.randn(3, 4, 32), torch.randn(2, 2, 32)
    rope = layers.rope_cos_sin_cache(32, 16, 10000.0, RopeScaling())
    with pytest.raises(RuntimeError):
        layer_ops.apply_rotary(LIB, q, k, torch.arange(3), rope)


def test_unsupported_inputs_fall_back_to_torch() -> None:
    q = torch.randn(5, 4, 32, dtype=torch.float16)
    k = torch.randn(5, 2, 32, dtype=torch.float16)
    positions = torch.arange(5)
    cache = layers.rope_cos_sin_cache(32, 16, 10000.0, RopeScaling())
    for lib in (LIB, None):
        out = layer_ops.apply_rotary(lib, q, k, positions, cache)
        expected = layers.apply_rotary(q, k, positions, cache)
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])


def test_rotary_positions_beyond_the_table_raise() -> None:
    q, k = torch.randn(2, 4, 32), torch.randn(2, 2, 32)
    cache = layers.rope_cos_sin_cache(32, 16, 10000.0, RopeScaling())
    with pytest.raises(IndexError, match="16 positions"):
        layer_ops.apply_rotary(LIB, q, k, torch.tensor([3, 16]), cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 576), (32, 576), (300, 576), (7, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_bit_identical(
    dtype: torch.dtype, num_tokens: int, hidden: int, with_residual: bool
) -> None:
    """Both outputs (normed, next residual), over rows of very different scales and many seeds:
    the variance must be torch's to the last bit, or bf16 rounding flips values."""
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        scales = 10.0 ** torch.randint(-3, 4, (num_tokens, 1), generator=gen)
        x = (torch.randn(num_tokens, hidden, generator=gen) * scales).to(dtype)
        residual = (torch.randn(num_tokens, hidden, generator=gen) * scales).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        res = residual if with_residual else None
        out, new_residual = layer_ops.rms_norm(LIB, x, weight, 1e-5, res)
        ref, ref_residual = layers.rms_norm(x, weight, 1e-5, res)
        assert_matches(out, ref)
        assert_matches(new_residual, ref_residual)
        if not with_residual:
            assert new_residual is x  # x itself is the residual, as in the torch version


def test_rms_norm_falls_back_for_what_the_kernel_does_not_take() -> None:
    x = torch.randn(6, 64)
    weight = torch.randn(64)
    cases = [
        (x.half(), weight.half(), None),  # another dtype
        (x.t().contiguous().t(), weight, None),  # non-contiguous rows
        (x, weight, x.t().contiguous().t()),  # non-contiguous residual
        (x.view(2, 3, 64), weight, None),  # 3-d
    ]
    for xs, w, res in cases:
        for lib in (LIB, None):
            out, new_residual = layer_ops.rms_norm(lib, xs, w, 1e-6, res)
            ref, ref_residual = layers.rms_norm(xs, w, 1e-6, res)
            assert torch.equal(out, ref) and torch.equal(new_residual, ref_residual)
