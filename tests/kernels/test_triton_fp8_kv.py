"""The FP8 KV cache on the Triton path, under the interpreter: the KV write's bytes against torch's
cast (kv_quant.quantize) for every code's neighbourhood, the decode of all 256 codes, paged
attention (prefill chunks and decodes, GQA, several blocks, per-head scales that differ 12x)
against the torch reference on the same FP8 cache.

Tolerances: the reference dequantizes float(code) * scale into the query's dtype and attends in
it; the kernel dots the exact codes and applies the scales in float32. float32 queries: 2e-5
absolute (summation order; outputs reach ~10); bfloat16: 2e-2 absolute plus 1% relative (the
reference rounds the dequantized keys and values to bfloat16), as the CPU kernels' FP8 tests.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton.language as tl

from kvpilot.engine.attention.kv_quant import fp8_max, quantize
from kvpilot.engine.attention.torch_ref import paged_attention_reference, write_kv_reference
from kvpilot.engine.kernels import attention, kv_cache
from kvpilot.engine.kernels.attention_backend import TritonAttentionBackend
from kvpilot.engine.kernels.numerics import FP8_FORMATS, fp8_decode
from kvpilot.engine.kernels.runtime import triton_kernel

from .conftest import PagedBatch

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3fn"), pytest.param(torch.float8_e5m2, id="e5m2")]
TOLERANCES = {torch.float32: (2e-5, 0.0), torch.bfloat16: (2e-2, 1e-2)}


def neighbourhoods(fp8: torch.dtype) -> torch.Tensor:
    """Every finite code's value, the float32 values next to it, the midpoints between adjacent
    codes (ties: round to even) and their neighbours, past the range (saturation), infinities,
    NaNs, zeros and float32 subnormals."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[torch.isfinite(values)]
    up, down = torch.full_like(values, float("inf")), torch.full_like(values, float("-inf"))
    ordered = values.unique()
    mids = (ordered[1:] + ordered[:-1]) / 2
    top = fp8_max(fp8)
    edges = [top * 1.01, -top * 1.01, 2 * top, float("inf"), float("-inf"), float("nan"), 0.0]
    edges += [-float("nan"), -0.0, 1e-40, -1e-40]
    return torch.cat(
        [
            values,
            torch.nextafter(values, up),
            torch.nextafter(values, down),
            mids,
            torch.nextafter(mids, up[: len(mids)]),
            torch.nextafter(mids, down[: len(mids)]),
            torch.tensor(edges),
        ]
    )


@pytest.mark.parametrize("fp8", FP8)
def test_write_kernel_matches_torchs_cast_bit_for_bit(fp8: torch.dtype) -> None:
    x = neighbourhoods(fp8)
    head_dim, heads = 256, 2
    per_token = heads * head_dim
    x = torch.cat([x, torch.zeros(-len(x) % per_token)])
    scales = torch.tensor([1.0, 0.5])
    # Head h holds x * scale[h], so that every value reaches the encoder after the division.
    key = x.view(-1, heads, head_dim) * scales[:, None]
    value = -key.flip(0)
    num_tokens = key.shape[0]
    cache = torch.zeros(2, 4, heads, head_dim, dtype=fp8)
    caches = [cache.clone() for _ in range(4)]
    slots = torch.randperm(8)[:num_tokens]  # scattered over both blocks
    kv_cache.write_kv(key, value, caches[0], caches[1], slots, k_scale=scales, v_scale=scales / 2)
    write_kv_reference(key, value, caches[2], caches[3], slots, scales, scales / 2)
    for got, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    # Past the range: the largest finite code, not NaN.
    saturated = quantize(torch.tensor([[2 * fp8_max(fp8)]]), torch.ones(1), fp8)
    assert torch.isfinite(saturated.float()).all()
    assert bool((caches[0].view(torch.uint8) == saturated.view(torch.uint8)).any())


@triton_kernel
def _decode_codes_kernel(code_ptr, out_ptr, N: tl.constexpr, MANT: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, fp8_decode(tl.load(code_ptr + offs), MANT).to(tl.float32))


@pytest.mark.parametrize("fp8", FP8)
def test_decode_reads_all_256_codes_as_torch_does(fp8: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    fmt = FP8_FORMATS[fp8]
    _decode_codes_kernel.on(codes.device)[(1,)](codes, out, N=256, MANT=fmt.mant)
    torch.testing.assert_close(
        out * fmt.f16_factor, codes.view(fp8).float(), atol=0, rtol=0, equal_nan=True
    )


def fp8_cache(
    batch: PagedBatch, fp8: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's cache with each KV head at its own range, quantized with per-head scales."""
    ranges = torch.linspace(0.5, 6.0, batch.k_cache.shape[2])
    k, v = batch.k_cache.float() * ranges[:, None], batch.v_cache.float() * ranges.flip(0)[:, None]
    k_scale = k.abs().amax(dim=(0, 1, 3)) / fp8_max(fp8)
    v_scale = v.abs().amax(dim=(0, 1, 3)) / fp8_max(fp8)
    return quantize(k, k_scale, fp8), quantize(v, v_scale, fp8), k_scale, v_scale


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(
    ("dtype", "seqs", "num_splits"),
    [
        # Prefill chunks (from scratch, over a prefix ending mid-block) beside decodes.
        (torch.float32, [(0, 7), (20, 1), (33, 1), (9, 12)], None),
        (torch.bfloat16, [(0, 7), (20, 1), (33, 1), (9, 12)], None),
        # Decodes only, with split-K (the V scale applies to each split's partial sum).
        (torch.float32, [(40, 1), (3, 1), (70, 1)], 2),
    ],
    ids=["mixed-fp32", "mixed-bf16", "decode-split-fp32"],
)
def test_paged_attention_matches_reference_on_the_same_fp8_cache(
    fp8: torch.dtype,
    dtype: torch.dtype,
    seqs: list[tuple[int, int]],
    num_splits: int | None,
    paged_batch: Callable[..., PagedBatch],
) -> None:
    batch = paged_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=24, block_size=8, dtype=dtype)
    k8, v8, k_scale, v_scale = fp8_cache(batch, fp8)
    assert not torch.allclose(k_scale[0], k_scale[1])
    scale = 24**-0.5
    out = attention.paged_attention(
        batch.query, k8, v8, batch.meta, scale, num_splits=num_splits, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    expected = paged_attention_reference(
        batch.query, k8, v8, batch.meta, scale, k_scale=k_scale, v_scale=v_scale
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def test_kernels_refuse_missing_or_misshapen_scales(
    paged_batch: Callable[..., PagedBatch],
) -> None:
    batch = paged_batch([(0, 3)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                        dtype=torch.float32)  # fmt: skip
    k8, v8, k_scale, v_scale = fp8_cache(batch, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs k_scale"):
        attention.paged_attention(batch.query, k8, v8, batch.meta, 1.0)
    with pytest.raises(ValueError, match="needs v_scale"):
        kv_cache.write_kv(batch.key, batch.value, k8, v8, batch.meta.slot_mapping,
                          k_scale=k_scale, v_scale=v_scale[:1])  # fmt: skip
    with pytest.raises(ValueError, match="for an FP8 cache"):
        attention.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 1.0,
                                  k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert TritonAttentionBackend.reads_fp8
