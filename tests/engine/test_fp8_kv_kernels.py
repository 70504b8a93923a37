"""The FP8 KV cache's number format and the attention paths that read it: the CPU C kernels
(decode and varlen, e4m3 and e5m2, float32 and bfloat16 queries, per-head scales) against the
torch reference on the same FP8 cache.

The reference dequantizes into float32 (float(byte) * scale[head], kv_quant.py) and attends in
float32, so it is the exact answer up to float32 rounding; the kernels decode the same bytes with
a table and fold the scales into the query and the output. Tolerances as in test_cpu_attention:
float32 2e-5 (summation order), bfloat16 2e-2 plus 1% relative (one rounding of the query and of
the output, whose values here reach ~30: the heads' ranges differ up to 16x).
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.attention.kv_quant import dequantize, fp8_max, quantize
from kvpilot.engine.attention.torch_ref import TorchAttentionBackend, paged_attention_reference
from kvpilot.engine.cpu.attention_backend import (
    CpuAttentionBackend,
    is_supported,
    paged_attention,
    paged_decode,
)
from kvpilot.engine.cpu.build import load_library
from tests.engine.test_cpu_attention import ATOL, LIB, make_batch, needs_kernel

RTOL = {torch.float32: 0.0, torch.bfloat16: 1e-2}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    fp8: torch.dtype,
):  # type: ignore[no-untyped-def]
    """make_batch's cache with each KV head at its own range, quantized with per-head scales."""
    query, k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32
    )
    ranges = torch.linspace(0.5, 8.0, num_kv_heads)
    k_cache, v_cache = k_cache * ranges[:, None], v_cache * ranges.flip(0)[:, None]
    k_scale = k_cache.abs().amax(dim=(0, 1, 3)) / fp8_max(fp8)
    v_scale = v_cache.abs().amax(dim=(0, 1, 3)) / fp8_max(fp8)
    k8, v8 = quantize(k_cache, k_scale, fp8), quantize(v_cache, v_scale, fp8)
    return query.to(dtype), k8, v8, k_scale, v_scale, meta


def reference(query, k8, v8, k_scale, v_scale, meta, scale):  # type: ignore[no-untyped-def]
    k = dequantize(k8, k_scale, torch.float32)
    v = dequantize(v8, v_scale, torch.float32)
    return paged_attention_reference(query.float(), k, v, meta, scale)


def test_quantize_round_trip_and_saturation() -> None:
    x = torch.randn(64, 4, 32) * torch.tensor([0.01, 1.0, 30.0, 500.0])[:, None]
    scale = x.abs().amax(dim=(0, 2)) / fp8_max(torch.float8_e4m3fn)
    back = dequantize(quantize(x, scale, torch.float8_e4m3fn), scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: within half a step (2^-4 relative) of every normal value.
    big = x.abs() > scale[:, None] * 2**-6
    assert ((back - x).abs()[big] <= x.abs()[big] * 2**-4 + 1e-12).all()
    # Past the range a value saturates at the largest finite value, never NaN or inf.
    out = quantize(x * 10, scale, torch.float8_e4m3fn).float()
    assert torch.isfinite(out).all() and out.abs().max() == fp8_max(torch.float8_e4m3fn)


@needs_kernel
@pytest.mark.parametrize("fp8", FP8)
def test_kernel_decodes_every_byte_as_torch_does(fp8: torch.dtype) -> None:
    """One cached token: the decode's output is that token's V row, each of the 256 bytes read
    by the kernel's table, compared with torch's own cast (NaN and inf included)."""
    v8 = torch.arange(256, dtype=torch.uint8).view(fp8).reshape(1, 1, 1, 256)
    k8 = torch.zeros_like(v8)
    query = torch.randn(1, 1, 256)
    ones = torch.ones(1)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    out = paged_decode(LIB, query, k8, v8, tables, lens, 1.0, ones, ones)
    torch.testing.assert_close(out.reshape(-1), v8.reshape(-1).float(), equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 32)],
)
def test_decode_matches_reference(
    fp8: torch.dtype,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    seq_lens = [1, 2, block_size + 1, 77, 300, 513]
    query, k8, v8, ks, vs, meta = fp8_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, fp8
    )
    scale = head_dim**-0.5
    assert is_supported(query, k8, v8)
    out = paged_decode(LIB, query, k8, v8, meta.block_tables, meta.seq_lens, scale, ks, vs)
    assert out.dtype == dtype
    expected = reference(query, k8, v8, ks, vs, meta, scale)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


@needs_kernel
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_reference(fp8: torch.dtype, dtype: torch.dtype) -> None:
    """Prefill chunks over a cached prefix or not, beside decodes, in one call."""
    query_lens, seq_lens = [40, 1, 70, 1, 5], [40, 33, 200, 513, 21]
    query, k8, v8, ks, vs, meta = fp8_batch(query_lens, seq_lens, 12, 4, 64, 16, dtype, fp8)
    out = paged_attention(LIB, query, k8, v8, meta, 0.125, ks, vs)
    assert out is not None
    expected = reference(query, k8, v8, ks, vs, meta, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_path(dtype: torch.dtype) -> None:
    """The plain-C loops (no AVX-512), where this machine has AVX-512."""
    portable = load_library(("-mno-avx512f",))
    assert portable is not None
    query, k8, v8, ks, vs, meta = fp8_batch(
        [1, 1, 30], [7, 300, 90], 8, 2, 64, 16, dtype, torch.float8_e4m3fn
    )
    out = paged_attention(portable, query, k8, v8, meta, 0.125, ks, vs)
    assert out is not None
    expected = reference(query, k8, v8, ks, vs, meta, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


@pytest.mark.parametrize("fp8", FP8)
def test_backends_write_and_read_the_same_cache(fp8: torch.dtype) -> None:
    """write_kv through each backend stores the same bytes; each backend's attention over them is
    the reference's over the dequantized cache, and that stays close to attention over the
    unquantized keys and values (mean error well under the values' scale of 1)."""
    gen = torch.Generator().manual_seed(3)
    block_size, kvh, head_dim, n = 16, 2, 64, 50
    key = torch.randn(n, kvh, head_dim, generator=gen) * torch.tensor([0.5, 2.0])[:, None]
    value = torch.randn(n, kvh, head_dim, generator=gen)
    query = torch.randn(n, 8, head_dim, generator=gen)
    ks = key.abs().amax(dim=(0, 2)) * 2 / fp8_max(fp8)
    vs = value.abs().amax(dim=(0, 2)) * 2 / fp8_max(fp8)
    _, full_k, _, meta = make_batch([n], [n], 8, kvh, head_dim, block_size, torch.float32)
    table = meta.block_tables[0].long()
    slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
    meta = type(meta)(**{**meta.__dict__, "slot_mapping": slots})
    full_k, full_v = torch.zeros_like(full_k), torch.zeros_like(full_k)
    torch_ref = TorchAttentionBackend()
    torch_ref.write_kv(key, value, full_k, full_v, slots)
    exact = torch_ref.forward(query, full_k, full_v, meta, 0.125)
    caches = []
    for backend in (torch_ref, CpuAttentionBackend()):
        k8, v8 = torch.zeros_like(full_k, dtype=fp8), torch.zeros_like(full_v, dtype=fp8)
        backend.write_kv(key, value, k8, v8, slots, k_scale=ks, v_scale=vs)
        out = backend.forward(query, k8, v8, meta, 0.125, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(
            out, reference(query, k8, v8, ks, vs, meta, 0.125), atol=2e-5, rtol=0
        )
        # e4m3 keeps 3 mantissa bits (2^-4 relative per value), e5m2 2 (2^-3).
        assert (out - exact).abs().mean() < (0.02 if fp8 == FP8[0] else 0.04)
        caches.append((k8.view(torch.uint8), v8.view(torch.uint8)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
