"""kvpilot's CPU linear kernel (csrc/linear.c through engine/cpu/linear.py): what it computes
against a float64 reference with a rounding-error bound, where it is used, and where not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpilot.engine.cpu.build import SUFFIXES, load_library
from kvpilot.engine.cpu.linear import (
    KernelLinear,
    kernel_available,
    kernel_takes,
    pack_weight,
    use_kernel_linears,
)
from kvpilot.engine.model.cpu_linear import PackedLinear, packing_available

LIB = load_library()
DTYPES = [torch.float32, torch.bfloat16]


def needs_kernel(dtype: torch.dtype) -> None:
    if not kernel_available(LIB, dtype):
        pytest.skip(f"this CPU or build has no linear kernel for {dtype}")


def assert_within_rounding(out: torch.Tensor, linear: nn.Linear, x: torch.Tensor) -> None:
    """|out - x W^T - b| (in float64) within the float32 accumulation bound K * 2^-24 *
    (|x| |W|^T + |b|), times 2, plus in bfloat16 the final rounding's half ulp (2^-8 relative)."""
    w = linear.weight.detach().double()
    x64 = x.double()
    exact = x64 @ w.t()
    magnitude = x64.abs() @ w.abs().t()
    if linear.bias is not None:
        exact = exact + linear.bias.detach().double()
        magnitude = magnitude + linear.bias.detach().double().abs()
    bound = 2 * linear.in_features * 2.0**-24 * magnitude
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    error = (out.double() - exact).abs()
    worst = (error - bound).max().item()
    assert worst <= 0, f"error {error.max().item():.3g} beyond the bound by {worst:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 64, 65, 130])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(960, 576), (80, 1536), (48, 100), (32, 6)]
)
def test_kernel_linear_matches_float64_within_rounding(
    dtype: torch.dtype, bias: bool, rows: int, out_features: int, in_features: int
) -> None:
    """Every tile shape: 1-8 rows, 1-3 panels (80 columns = 5 panels: a full tile and a tile of
    2), more than one 64-row chunk, K in blocks of 64 with a remainder (100), and K under one
    vector."""
    needs_kernel(dtype)
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    out = KernelLinear(LIB, linear)(x)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    assert_within_rounding(out, linear, x)
    # and as close to torch's own product as the usual per-dtype tolerances (a bfloat16 ulp)
    tol = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-3)}[dtype]
    torch.testing.assert_close(out, linear(x), rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_linear_takes_strided_rows_and_leading_dimensions(dtype: torch.dtype) -> None:
    needs_kernel(dtype)
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    layer = KernelLinear(LIB, linear)
    wide = torch.randn(10, 100).to(dtype)
    rows = wide[:, 20:84]  # row stride 100, not 64
    assert rows.stride(0) == 100
    torch.testing.assert_close(layer(rows), layer(rows.contiguous()), rtol=0, atol=0)
    batch = torch.randn(2, 5, 64).to(dtype)
    out = layer(batch)
    assert out.shape == (2, 5, 48)
    torch.testing.assert_close(out, layer(batch.reshape(10, 64)).reshape(2, 5, 48), rtol=0, atol=0)
    assert layer(torch.empty(0, 64, dtype=dtype)).shape == (0, 48)
    with pytest.raises(TypeError, match="got"):
        layer(torch.randn(3, 64, dtype=torch.float16))
    with pytest.raises(TypeError, match="got"):
        layer(torch.randn(3, 63).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_linear_computes_every_item_whatever_the_team(dtype: torch.dtype) -> None:
    """The threads split the items in runs and steal from each other's far ends: with 1, 3 and 7
    threads on this machine's cores (7 oversubscribes, so threads are preempted mid-call and the
    others steal their items), every output is written (the buffer starts as NaN) and equals one
    thread's bit for bit, call after call."""
    needs_kernel(dtype)
    assert LIB is not None
    torch.manual_seed(0)
    rows, out_features, in_features = 130, 960, 576  # 3 chunks x 20 groups: 60 items
    kernel = KernelLinear(LIB, nn.Linear(in_features, out_features).to(dtype))
    assert kernel.bias is not None
    x = torch.randn(rows, in_features).to(dtype)
    fn = getattr(LIB, f"linear_{SUFFIXES[dtype]}")

    def call() -> torch.Tensor:
        out = torch.full((rows, out_features), float("nan"), dtype=dtype)
        pointers = (x, kernel.packed_weight, kernel.bias, out)
        sizes = (rows, out_features, in_features, in_features, out_features)
        assert fn(*(t.data_ptr() for t in pointers), *sizes) == 0
        return out

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = call()
        assert not expected.isnan().any()
        for threads in (3, 7):
            torch.set_num_threads(threads)
            for _ in range(30):
                assert torch.equal(call(), expected), f"{threads} threads"
    finally:
        torch.set_num_threads(before)


def test_pack_weight_layouts() -> None:
    """Groups of 48 columns (the last 16 or 32), each float32 [K, width], or bfloat16
    [K/2, width, 2]: element (k, n) of group g at its row k (pair k // 2) and column n - 48 g."""
    weight = torch.arange(80 * 6, dtype=torch.float32).reshape(80, 6)
    packed = pack_weight(weight)
    assert packed.shape == (80 * 6,)
    first, last = packed[: 6 * 48].reshape(6, 48), packed[6 * 48 :].reshape(6, 32)
    assert torch.equal(first, weight[:48].t()) and torch.equal(last, weight[48:].t())
    packed_bf16 = pack_weight(weight.to(torch.bfloat16))
    last_bf16 = packed_bf16[6 * 48 :].reshape(3, 32, 2)
    assert torch.equal(last_bf16[2, 5], weight[53, 4:6].to(torch.bfloat16))


def test_kernel_takes_only_its_shapes() -> None:
    assert kernel_takes(nn.Linear(6, 32))
    assert not kernel_takes(nn.Linear(6, 24))  # not whole 16-column panels
    assert kernel_takes(nn.Linear(6, 32).to(torch.bfloat16))
    assert not kernel_takes(nn.Linear(7, 32).to(torch.bfloat16))  # bfloat16 takes k in pairs
    assert not kernel_takes(nn.Linear(6, 32).to(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_use_kernel_linears_swaps_what_it_takes_and_packs_the_rest(dtype: torch.dtype) -> None:
    needs_kernel(dtype)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 24), nn.LayerNorm(24)).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    before = model(x)
    assert use_kernel_linears(model, LIB, dtype, batch_hint=8) == 1
    assert isinstance(model[0], KernelLinear)
    other = PackedLinear if packing_available(dtype) else nn.Linear
    assert type(model[1]) is other
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.05}
    torch.testing.assert_close(model(x), before, **tol)


def test_no_library_or_dtype_swaps_nothing() -> None:
    model = nn.Sequential(nn.Linear(64, 64))
    assert use_kernel_linears(model, None, torch.float32, batch_hint=8) == 0
    assert type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="does not take"):
        KernelLinear(LIB, nn.Linear(6, 24))  # type: ignore[arg-type]


def test_portable_build_has_no_kernel_and_says_so() -> None:
    """Without AVX-512 the library builds, reports no kernel, and the call writes nothing."""
    needs_kernel(torch.float32)
    portable = load_library(("-mno-avx512f",))
    assert portable is not None and portable is not LIB
    assert portable.kvpilot_linear_available() == 0
    assert not kernel_available(portable, torch.float32)
    y = torch.full((1, 16), 7.0)
    x, w = torch.ones(1, 4), torch.ones(1, 4, 16)
    assert portable.linear_f32(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 1, 16, 4, 4, 16)
    assert torch.equal(y, torch.full((1, 16), 7.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_uses_the_kernel_with_the_cpu_backend_and_onednn_with_torch(dtype: str) -> None:
    from kvpilot.engine import LLM

    needs_kernel(getattr(torch, dtype))
    kwargs = {"dtype": dtype, "load_format": "dummy", "max_model_len": 64, "kv_cache_gib": 0.05}
    model = LLM(**kwargs).engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, KernelLinear)
    assert isinstance(model.lm_head, KernelLinear)
    assert model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    if packing_available(getattr(torch, dtype)):
        reference = LLM(attention_backend="torch", **kwargs).engine.runner.model
        assert isinstance(reference.model.layers[0].mlp.down_proj, PackedLinear)


@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_over_the_streaming_threshold_equal_small_calls_bit_for_bit(
    dtype: torch.dtype,
) -> None:
    """An output of at least kvpilot_linear_stream_bytes() is written with streaming stores (an
    aligned one) or ordinary ones (one 16 bytes off): every row equals the same row computed in a
    call of 8 rows, under the threshold, bit for bit, and nothing is left unwritten (NaN)."""
    needs_kernel(dtype)
    assert LIB is not None
    torch.manual_seed(0)
    out_features, in_features = 960, 576
    elem = torch.empty((), dtype=dtype).element_size()
    threshold = LIB.kvpilot_linear_stream_bytes()
    rows = threshold // (out_features * elem) + 9  # over it, and not a whole number of chunks
    kernel = KernelLinear(LIB, nn.Linear(in_features, out_features).to(dtype))
    x = torch.randn(rows, in_features).to(dtype)
    expected = torch.cat([kernel(x[start : start + 8]) for start in range(0, rows, 8)])
    assert 8 * out_features * elem < threshold <= rows * out_features * elem
    fn = getattr(LIB, f"linear_{SUFFIXES[dtype]}")
    pad = 16 // elem  # elements in 16 bytes: misaligns every row for a 32- or 64-byte store
    aligned = torch.full((rows, out_features), float("nan"), dtype=dtype)
    assert aligned.data_ptr() % 64 == 0 and out_features * elem % 64 == 0
    off_by_16 = torch.full((rows, out_features + pad), float("nan"), dtype=dtype)[:, pad:]
    for out in (aligned, off_by_16):
        pointers = (x, kernel.packed_weight, kernel.bias, out)
        sizes = (rows, out_features, in_features, in_features, out.stride(0))
        assert fn(*(t.data_ptr() for t in pointers), *sizes) == 0
        assert torch.equal(out, expected), f"row stride {out.stride(0)}"
