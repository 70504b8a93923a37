"""Packed linear layers compute what nn.Linear computes, and the model runner uses them on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpilot.engine.model.cpu_linear import (
    PACKED_DTYPES,
    PackedLinear,
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

    llm = LLM(dtype=dtype, load_format="dummy", max_model_len=64, kv_cache_gib=0.05)
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear)
    assert isinstance(layer.mlp.down_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)
    assert model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
