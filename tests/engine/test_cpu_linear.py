"""Packed bfloat16 linear layers compute what nn.Linear computes, and the model runner uses them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpilot.engine.model.cpu_linear import PackedLinear, pack_linears, packing_available

needs_packing = pytest.mark.skipif(
    not packing_available(), reason="this torch/CPU has no oneDNN bfloat16 linear"
)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 300])
def test_packed_linear_matches_nn_linear(bias: bool, num_tokens: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576).to(torch.bfloat16)
    expected = linear(x)
    packed = PackedLinear(linear, batch_hint=32)
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    # Same oneDNN bf16 kernel family with float32 accumulation: differences stay at bf16 rounding.
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=1e-2)


@needs_packing
def test_pack_linears_swaps_bf16_cpu_linears_only() -> None:
    model = nn.Sequential(
        nn.Linear(64, 64).to(torch.bfloat16),
        nn.LayerNorm(64).to(torch.bfloat16),
        nn.Linear(64, 32),  # float32: left alone
    )
    x = torch.randn(5, 64).to(torch.bfloat16)
    before = model[0](x)
    assert pack_linears(model, batch_hint=8) == 1
    assert isinstance(model[0], PackedLinear) and type(model[2]) is nn.Linear
    torch.testing.assert_close(model[0](x).float(), before.float(), atol=2e-2, rtol=1e-2)


@needs_packing
def test_runner_packs_bf16_model_and_keeps_tied_embedding() -> None:
    from kvpilot.engine import LLM

    llm = LLM(dtype="bfloat16", load_format="dummy", max_model_len=64, kv_cache_gib=0.05)
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear)
    assert isinstance(layer.mlp.down_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
