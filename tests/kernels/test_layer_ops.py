"""Fused RMSNorm, SiLU-and-mul and rotary against kvpilot.engine.model.layers (the reference)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvpilot.engine.config import RopeScaling
from kvpilot.engine.kernels import get_layer_ops
from kvpilot.engine.kernels.activation import silu_and_mul
from kvpilot.engine.kernels.rms_norm import rms_norm
from kvpilot.engine.kernels.rotary import apply_rotary
from kvpilot.engine.model import layers
from kvpilot.engine.model.layer_ops import LayerOps

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", (64, 96, 576))  # 96: not a power of two; 576: SmolLM2-135M
@pytest.mark.parametrize("with_residual", (False, True))
def test_rms_norm(
    with_residual: bool, hidden: int, dtype: torch.dtype, assert_close: Callable[..., None]
) -> None:
    x = randn(7, hidden, dtype=dtype, seed=1)
    weight = (1 + 0.1 * randn(hidden, dtype=torch.float32, seed=2)).to(dtype)
    residual = randn(7, hidden, dtype=dtype, seed=3) if with_residual else None
    out, res_out = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = layers.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert_close(out, ref_out)
    if with_residual:
        # The sum is rounded to the dtype exactly like the unfused `x + residual`.
        assert torch.equal(res_out, ref_res)
    else:
        assert res_out is x


def test_rms_norm_3d_input_and_fp32_weight(assert_close: Callable[..., None]) -> None:
    x = randn(2, 3, 64, dtype=torch.bfloat16)
    weight = randn(64, dtype=torch.float32, seed=4)
    out, _ = rms_norm(x, weight, 1e-6)
    ref, _ = layers.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 64)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", (64, 1536, 100))  # 1536: SmolLM2-135M; 1536 > one block
def test_silu_and_mul(
    dtype: torch.dtype, intermediate: int, assert_close: Callable[..., None]
) -> None:
    gate_up = 3 * randn(5, 2 * intermediate, dtype=dtype, seed=5)
    out = silu_and_mul(gate_up)
    assert out.shape == (5, intermediate)
    assert_close(out, layers.silu_and_mul(gate_up))


def test_silu_and_mul_leading_dims(assert_close: Callable[..., None]) -> None:
    gate_up = randn(2, 3, 128, dtype=torch.float32)
    assert_close(silu_and_mul(gate_up), layers.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), ((9, 3, 64), (8, 2, 128), (4, 4, 32))
)
@pytest.mark.parametrize("rope_type", ("default", "llama3"))
def test_rotary(
    rope_type: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    assert_close: Callable[..., None],
) -> None:
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 64) if rope_type == "llama3" else RopeScaling()
    cache = layers.rope_cos_sin_cache(head_dim, 512, 500000.0, scaling)
    # A fused qkv output, sliced: query and key are strided views, as in the model.
    num_tokens = 11
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, seed=6)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.tensor([0, 1, 2, 3, 17, 100, 511, 5, 6, 7, 250])
    before = qkv.clone()
    q, k = apply_rotary(query, key, positions, cache)
    q_ref, k_ref = layers.apply_rotary(query, key, positions, cache)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(qkv, before)  # out of place, like the reference


def test_get_layer_ops() -> None:
    assert get_layer_ops("torch") == LayerOps(
        layers.rms_norm, layers.silu_and_mul, layers.apply_rotary
    )
    assert get_layer_ops("triton") == LayerOps(rms_norm, silu_and_mul, apply_rotary)
    with pytest.raises(ValueError, match="must be one of"):
        get_layer_ops("cuda")


def test_falls_back_to_torch_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU without TRITON_INTERPRET the fused ops are the torch ops, bit for bit."""
    import kvpilot.engine.kernels.rms_norm as rms_module

    monkeypatch.delenv("TRITON_INTERPRET")
    launched: list[object] = []
    monkeypatch.setattr(rms_module._rms_norm_kernel, "on", lambda device: launched.append(device))
    x, w = randn(3, 64, dtype=torch.float32), randn(64, dtype=torch.float32, seed=1)
    assert torch.equal(rms_norm(x, w, 1e-6)[0], layers.rms_norm(x, w, 1e-6)[0])
    gate_up = randn(3, 64, dtype=torch.float32)
    assert torch.equal(silu_and_mul(gate_up), layers.silu_and_mul(gate_up))
    assert launched == []
