"""The C elementwise steps against the torch versions they replace: identical results, since both
compute in float32 and round to the storage dtype at the same points (SiLU-and-multiply: in
bfloat16; its float32 result differs in the last bits, through its own exp)."""

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


def test_the_c_sum_adds_in_torchs_order_at_one_vector_width() -> None:
    """The load-time check finds the width with which the C sum reproduces torch's sum (and
    mean) bit for bit; the check's rows tell the widths apart, so a changed torch order fails it
    (then RMSNorm keeps torch's mean: slower, still exact) and fails here, loudly."""
    lanes = layer_ops.torch_sum_lanes(LIB)
    assert lanes in (4, 8, 16), "torch's CPU sum no longer adds in the order torch_order_sum does"
    gen = torch.Generator().manual_seed(1)
    rows = (torch.rand(8, 5003, generator=gen) + 0.5) * torch.exp2(
        torch.randint(-6, 6, (8, 5003), generator=gen)
    )
    assert layer_ops._sums_match(LIB, rows, lanes)
    for other in {4, 8, 16} - {lanes}:
        assert not layer_ops._sums_match(LIB, rows, other)


def test_the_fused_rms_norm_refuses_widths_it_has_no_sum_for() -> None:
    x = torch.randn(2, 576)
    out = torch.zeros_like(x)
    for lanes in (0, 5, 32):
        failed = LIB.rms_norm_fused_f32(
            x.data_ptr(), None, x.data_ptr(), x[0].data_ptr(), 1e-5, out.data_ptr(), 2, 576, lanes
        )
        assert failed == 1 and not out.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "hidden"),
    [(1, 576), (32, 576), (65, 576), (300, 576), (2048, 576), (7, 4096), (5, 1001), (3, 8219)],
)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("fused", [False, True], ids=["torch-mean", "fused"])
def test_rms_norm_is_bit_identical(
    dtype: torch.dtype, num_tokens: int, hidden: int, with_residual: bool, fused: bool
) -> None:
    """Both outputs (normed, next residual), over rows of very different scales and many seeds:
    the variance must be torch's to the last bit, or bf16 rounding flips values. Fused: one C
    call with the sum in torch's order (rows split over threads past 64 tokens; a scalar tail at
    1001 and 8219; torch's cascade of partial sums at 4096 and 8219); else torch's own mean."""
    lanes = layer_ops.torch_sum_lanes(LIB) if fused else None
    if fused and lanes is None:
        pytest.fail("no vector width reproduces torch's sum (see the test above)")
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        scales = 10.0 ** torch.randint(-3, 4, (num_tokens, 1), generator=gen)
        x = (torch.randn(num_tokens, hidden, generator=gen) * scales).to(dtype)
        residual = (torch.randn(num_tokens, hidden, generator=gen) * scales).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        res = residual if with_residual else None
        out, new_residual = layer_ops.rms_norm(LIB, x, weight, 1e-5, res, lanes=lanes)
        ref, ref_residual = layers.rms_norm(x, weight, 1e-5, res)
        assert_matches(out, ref)
        assert_matches(new_residual, ref_residual)
        if not with_residual:
            assert new_residual is x  # x itself is the residual, as in the torch version


def test_rms_norm_mean_on_one_thread_leaves_the_thread_count_and_the_result() -> None:
    """The mean of squares runs on this thread alone, then torch's team size is what it was; a
    2048-token step's mean is large enough that torch would split it over its threads."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 576, generator=gen).to(torch.bfloat16)
    residual = torch.randn(2048, 576, generator=gen).to(torch.bfloat16)
    weight = torch.randn(576, generator=gen).to(torch.bfloat16)
    before = torch.get_num_threads()
    for threads in sorted({1, 2, before}):
        torch.set_num_threads(threads)
        try:
            serial = layer_ops.rms_norm(LIB, x, weight, 1e-5, residual)
            assert torch.get_num_threads() == threads
            parallel = layer_ops.rms_norm(LIB, x, weight, 1e-5, residual, serial_mean=False)
        finally:
            torch.set_num_threads(before)
        for a, b in zip(serial, parallel, strict=True):
            assert_matches(a, b)


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


def every_finite_bfloat16() -> torch.Tensor:
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return values[torch.isfinite(values)]


@pytest.mark.parametrize("up", [1.0, -0.3, 7.0])
def test_silu_and_mul_bfloat16_is_bit_identical_for_every_gate_value(up: float) -> None:
    """Every finite bfloat16 gate (subnormals, +-0, past exp's overflow at -88.7) in rows of 21
    (a 16-lane vector body and a scalar tail): torch's silu rounded to bfloat16, then the same
    rounded product."""
    gates = every_finite_bfloat16()
    gates = gates[: len(gates) // 21 * 21].view(-1, 21)
    gate_up = torch.cat([gates, torch.full_like(gates, up)], dim=1)
    assert_matches(layer_ops.silu_and_mul(LIB, gate_up), layers.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "inter"), [(1, 1536), (64, 1536), (300, 1536), (5, 37)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, num_tokens: int, inter: int) -> None:
    """The merged projection's output as the MLP hands it over, and a strided view of a wider
    matrix. bfloat16: bit for bit; float32: within 8 ulp (the exp polynomial, not torch's exp;
    5 ulp at most over a dense sweep of [-100, 100] on the development VM)."""
    gen = torch.Generator().manual_seed(0)
    wide = (4 * torch.randn(num_tokens, 2 * inter + 8, generator=gen)).to(dtype)
    for gate_up in (wide[:, : 2 * inter].contiguous(), wide[:, : 2 * inter]):
        out = layer_ops.silu_and_mul(LIB, gate_up)
        ref = layers.silu_and_mul(gate_up)
        if dtype == torch.bfloat16:
            assert_matches(out, ref)
        else:
            assert out.shape == ref.shape and out.dtype == ref.dtype
            torch.testing.assert_close(out, ref, rtol=8 * 2**-23, atol=1e-30)


def test_silu_and_mul_falls_back_for_what_the_kernel_does_not_take() -> None:
    """Equal to the torch version bit for bit, which in float32 the kernel is not (its exp)."""
    gate_up = torch.randn(6, 64)
    assert not torch.equal(layer_ops.silu_and_mul(LIB, gate_up), layers.silu_and_mul(gate_up))
    cases = [
        gate_up.half(),  # another dtype
        gate_up.view(2, 3, 64),  # 3-d
        gate_up.t().contiguous().t(),  # columns not contiguous
        torch.randn(1, 64).expand(6, 64),  # rows overlap (stride 0)
    ]
    for x in cases:
        for lib in (LIB, None):
            assert torch.equal(layer_ops.silu_and_mul(lib, x), layers.silu_and_mul(x))
    with pytest.raises(RuntimeError):  # an odd width is the torch version's to reject
        layer_ops.silu_and_mul(LIB, gate_up[:, :63])


@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (16, 49152), (9, 1000), (3, 7)])
def test_argmax_rows_gives_torchs_indices(rows: int, vocab: int) -> None:
    """Random rows (the parallel path from 8 rows, a tail after the 16-float vectors, rows shorter
    than one vector), then the cases an argmax gets wrong: ties (the first wins), -0.0 against
    0.0, infinities, NaN (the first NaN wins over any number), a row of -inf, and rows that are a
    strided view of wider logits."""
    gen = torch.Generator().manual_seed(rows * vocab)
    values = torch.randn(rows, vocab, generator=gen)
    cases = [values]
    tied = values.clone()
    tied[:, vocab // 3] = tied[:, -1] = tied.max() + 1  # the same largest value twice
    cases.append(tied)
    zeros = torch.full((rows, vocab), -1.0)
    zeros[:, vocab // 2] = -0.0
    zeros[:, -1] = 0.0
    cases.append(zeros)
    special = values.clone()
    special[0, vocab // 2] = float("inf")
    special[-1, :] = float("-inf")
    cases.append(special)
    nans = values.clone()
    nans[:, -1] = float("nan")
    nans[0, vocab // 4] = float("nan")
    nans[:, 0] = float("inf")
    cases.append(nans)
    wide = torch.randn(rows, vocab + 40, generator=gen)
    cases.append(wide[:, 8 : 8 + vocab])
    for case in cases:
        assert torch.equal(layer_ops.argmax_rows(LIB, case), layers.argmax_rows(case))


def test_argmax_rows_falls_back_for_what_the_kernel_does_not_take() -> None:
    values = torch.randn(4, 100)
    for case in (values.to(torch.bfloat16), values.t(), values[0], values.double()):
        assert torch.equal(layer_ops.argmax_rows(LIB, case), layers.argmax_rows(case))
