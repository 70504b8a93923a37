"""One-token projections (kvpilot.engine.kernels.gemv), plain and with SiLU-and-mul fused in, under
the interpreter, against the separate torch ops: only the summation order differs (within the
dtype's tolerance)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from kvpilot.engine.kernels import gemv, get_layer_ops
from kvpilot.engine.model import layers
from kvpilot.engine.model.layer_ops import LayerOps

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def make_linear(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0) -> nn.Linear:
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(randn(n, k, dtype=torch.float32, seed=seed, scale=k**-0.5))
        if bias:
            linear.bias.copy_(randn(n, dtype=torch.float32, seed=seed + 1))
    return linear.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k", "bias"), ((100, 96, False), (960, 576, True), (72, 1100, True)))
def test_linear(
    n: int, k: int, bias: bool, dtype: torch.dtype, assert_close: Callable[..., None]
) -> None:
    """N not a multiple of the rows per program, K not a multiple of the keys per step, a bias."""
    proj = make_linear(n, k, dtype, bias)
    x = randn(1, k, dtype=dtype, seed=3)
    out = gemv.linear(x, proj)
    assert out is not None and out.dtype == dtype and out.shape == (1, n)
    assert_close(out, proj(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), ((96, 160), (576, 1536)))
def test_silu_and_mul_linear(
    n: int, k: int, dtype: torch.dtype, assert_close: Callable[..., None]
) -> None:
    proj = make_linear(n, k, dtype, bias=False)
    gate_up = randn(1, 2 * k, dtype=dtype, seed=7, scale=3.0)
    out = gemv.silu_and_mul_linear(gate_up, proj)
    assert out is not None
    assert_close(out, proj(layers.silu_and_mul(gate_up)))


def test_what_the_kernels_decline() -> None:
    """Where the kernel does not apply the launchers say so (None) and the model runs the separate
    ops: two or more rows, a module that is not a plain nn.Linear (the CPU's packed ones), an input
    of another dtype than the weights, a strided input, an odd gate_up width."""
    proj = make_linear(8, 16, torch.float32, bias=False)
    x = randn(1, 16, dtype=torch.float32, seed=1)
    assert gemv.linear(randn(2, 16, dtype=torch.float32, seed=1), proj) is None
    assert gemv.linear(x, nn.Sequential(proj)) is None
    assert gemv.linear(x.double(), proj) is None
    assert gemv.linear(randn(1, 32, dtype=torch.float32, seed=1)[:, ::2], proj) is None
    assert gemv.silu_and_mul_linear(randn(1, 31, dtype=torch.float32, seed=1), proj) is None
    assert gemv.linear(x, proj) is not None


def test_layer_ops_route_one_token_steps_through_the_fused_kernels(
    monkeypatch: pytest.MonkeyPatch, assert_close: Callable[..., None]
) -> None:
    """The 'triton' LayerOps: one row goes through the one-token kernels, several rows through
    the separate ops; both agree with the torch LayerOps."""
    ops, ref_ops = get_layer_ops("triton"), LayerOps()
    calls: list[int] = []
    real_launch = gemv._launch

    def counting_launch(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real_launch(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gemv, "_launch", counting_launch)
    proj, down = make_linear(48, 32, torch.float32, True), make_linear(32, 24, torch.float32, False)
    for rows in (1, 3):
        x = randn(rows, 32, dtype=torch.float32, seed=8)
        gate_up = randn(rows, 48, dtype=torch.float32, seed=10)
        activated = ops.activate_then_project(gate_up, down)
        assert_close(activated, ref_ops.activate_then_project(gate_up, down))
        assert_close(ops.project(x, proj), ref_ops.project(x, proj))
    assert calls == [1, 1]
