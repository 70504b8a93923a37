"""Packed linear layers compute what nn.Linear computes, and the model runner uses them on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpilot.engine.model import layers
from kvpilot.engine.model.cpu_linear import (
    PACKED_DTYPES,
    PackedLinear,
    PackedSiluGateUp,
    pack_linears,
    packing_available,
)

pytestmark = pytest.mark.skipif(
    not all(packing_available(dtype) for dtype in PACKED_DTYPES),
    reason="this torch/CPU has no oneDNN packed linear",
)


def assert_same_product(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.bfloat16:
        assert torch.equal(out, expected)  # the same oneDNN bf16 kernel family
    else:
        # oneDNN vs MKL sgemm: the same sums in another order (inputs O(1), 576 terms).
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 300])
def test_packed_linear_matches_nn_linear(dtype: torch.dtype, bias: bool, num_tokens: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=bias).to(dtype)
    x = torch.randn(num_tokens, 576).to(dtype)
    expected = linear(x)
    assert_same_product(PackedLinear(linear, batch_hint=32)(x), expected)


def test_pack_linears_swaps_cpu_linears_of_packed_dtypes_only() -> None:
    model = nn.Sequential(
        nn.Linear(64, 64).to(torch.bfloat16),
        nn.LayerNorm(64).to(torch.bfloat16),
        nn.Linear(64, 32).to(torch.float16),  # no packed float16: left alone
    )
    x = torch.randn(5, 64).to(torch.bfloat16)
    before = model[0](x)
    assert pack_linears(model, batch_hint=8) == 1
    assert isinstance(model[0], PackedLinear) and type(model[2]) is nn.Linear
    assert_same_product(model[0](x), before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_packs_the_model_and_keeps_the_tied_embedding(dtype: str) -> None:
    from kvpilot.engine import LLM

    # The torch backend: the cpu backend uses kvpilot's own kernel where it can
    # (test_cpu_kernel_linear.py).
    llm = LLM(
        dtype=dtype,
        load_format="dummy",
        max_model_len=64,
        kv_cache_gib=0.05,
        attention_backend="torch",
    )
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear)
    assert isinstance(layer.mlp.down_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)
    assert model.model.embed_tokens.weight.dtype == getattr(torch, dtype)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_fused_gate_up_matches_linear_then_silu_and_mul(
    dtype: torch.dtype, num_tokens: int
) -> None:
    """float32: to rounding. bfloat16: the fused path rounds once where the separate ops round
    the gate, the up product, silu and the product; against the float32 computation from the same
    bfloat16 weights it is never further off than the separate ops."""
    torch.manual_seed(0)
    linear = nn.Linear(576, 2 * 1536, bias=False).to(dtype)
    x = (4 * torch.randn(num_tokens, 576)).to(dtype)
    expected = layers.silu_and_mul(linear(x))
    out = PackedSiluGateUp(linear, batch_hint=32)(x)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)
        return
    truth = layers.silu_and_mul(x.float() @ linear.weight.float().t())
    fused_error = (out.float() - truth).abs().max()
    separate_error = (expected.float() - truth).abs().max()
    assert fused_error <= separate_error
    torch.testing.assert_close(out.float(), truth, rtol=2**-7, atol=1e-2)


def test_pack_linears_fuses_only_the_gate_up_projection() -> None:
    """A real MLP (both tensor-parallel halves of its width, as each rank builds them): the fused
    projection feeds down_proj directly and the block computes what it computed unpacked."""
    from kvpilot.engine.config import ModelConfig
    from kvpilot.engine.model.layer_ops import LayerOps
    from kvpilot.engine.model.llama import MLP
    from kvpilot.engine.parallel.sharding import Shard

    cfg = ModelConfig("llama", 100, 64, 192, 1, 4, 2, 16, 1e-5, 1e4, 128, False, False)
    for shard in (Shard(cfg), Shard(cfg, 1, 2)):
        torch.manual_seed(0)
        mlp = MLP(cfg, LayerOps(), shard, None)
        x = torch.randn(5, 64)
        before = mlp(x)
        assert pack_linears(mlp, batch_hint=8, fuse_gate_up=True) == 2
        assert isinstance(mlp.gate_up_proj, PackedSiluGateUp)
        assert mlp.gate_up_proj.inter == shard.intermediate_size
        assert isinstance(mlp.down_proj, PackedLinear)
        torch.testing.assert_close(mlp(x), before, rtol=1e-5, atol=2e-5)
    with pytest.raises(ValueError, match="no bias"):
        PackedSiluGateUp(nn.Linear(8, 6, bias=True), batch_hint=8)
