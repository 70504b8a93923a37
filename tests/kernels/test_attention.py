"""The paged-attention kernel against the torch reference, under the Triton interpreter on CPU.

The oracle is torch_ref evaluated in float32 on the very same (already rounded) fp16/bf16 inputs,
then rounded to the dtype: the reference run in bf16 rounds its intermediates too, and its own error
against float32 exceeds the kernel's (measured on the mixed batch: 0.0098 vs 0.0078 max abs), so
comparing two rounded results would test the reference's rounding rather than the kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from kvpilot.engine.attention.torch_ref import paged_attention_reference
from kvpilot.engine.kernels.attention import choose_num_splits, paged_attention

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (num_heads, num_kv_heads): MHA, GQA 2, GQA 3 (SmolLM2's 9/3: not a power of two), GQA 4, MQA.
HEAD_LAYOUTS = ((4, 4), (4, 2), (6, 2), (8, 2), (4, 1))
# (cached prefix length, query length) per sequence.
MIXED = ((0, 9), (30, 1), (17, 12), (63, 1), (100, 33))
BATCHES = {
    "decode": ((0, 1), (16, 1), (40, 1), (99, 1)),
    "prefill": ((0, 37),),
    "prefill_short": ((0, 3), (0, 1)),
    "chunk_after_full_blocks": ((32, 16),),
    "chunk_after_partial_block": ((19, 23),),
    "long_chunk_short_prefix": ((5, 70),),
    "mixed": MIXED,
}


def reference(batch: object, scale: float) -> torch.Tensor:
    query, k_cache, v_cache = (t.float() for t in (batch.query, batch.k_cache, batch.v_cache))
    out = paged_attention_reference(query, k_cache, v_cache, batch.meta, scale)
    return out.to(batch.query.dtype)


def run_both(
    batch: object, *, num_splits: int | None = None, tile_n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = 1.0 / math.sqrt(batch.query.shape[-1])
    out = paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        scale,
        num_splits=num_splits,
        tile_n=tile_n,
    )
    return out, reference(batch, scale)


BLOCK_SIZES = (16, 32, 64)


def pairwise(
    rows: tuple[object, ...], first: tuple[object, ...], second: tuple[object, ...]
) -> list[tuple[object, object, object]]:
    """Every (row, a, b) such that each row value meets every value of `first` and of `second`,
    and every value of `first` meets every value of `second`: a covering array of strength 2
    (each pair of parameter values tested at least once) in len(rows) * max(len) cases rather than
    the full product's. Row r takes first[i] with second[(i + r) % len(second)]."""
    size = max(len(first), len(second))
    return [
        (row, first[i % len(first)], second[(i + r) % len(second)])
        for r, row in enumerate(rows)
        for i in range(size)
    ]


def test_pairwise_covers_every_pair() -> None:
    cases = pairwise(HEAD_LAYOUTS, DTYPES, BLOCK_SIZES)
    assert {(h, d) for h, d, _ in cases} == {(h, d) for h in HEAD_LAYOUTS for d in DTYPES}
    assert {(h, b) for h, _, b in cases} == {(h, b) for h in HEAD_LAYOUTS for b in BLOCK_SIZES}
    assert {(d, b) for _, d, b in cases} == {(d, b) for d in DTYPES for b in BLOCK_SIZES}
    assert len(cases) == 15  # of the product's 45


# Each head layout with every dtype and every block size, and each dtype with every block size
# (pairwise): the kernel's dtype, GQA grouping and paging are independent code paths.
@pytest.mark.parametrize(
    ("heads", "dtype", "block_size"),
    pairwise(HEAD_LAYOUTS, DTYPES, BLOCK_SIZES),
    ids=lambda v: f"h{v[0]}kv{v[1]}" if isinstance(v, tuple) else str(v),
)
def test_mixed_batch_over_block_sizes_and_head_layouts(
    block_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    paged_batch: Callable[..., object],
    assert_close: Callable[..., None],
) -> None:
    batch = paged_batch(
        MIXED,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
    )
    out, ref = run_both(batch)
    assert_close(out, ref)


# Every batch shape with both head dims and both dtypes, and each head dim with each dtype.
@pytest.mark.parametrize(
    ("name", "head_dim", "dtype"),
    pairwise(tuple(sorted(BATCHES)), (64, 128), (torch.float32, torch.bfloat16)),
    ids=str,
)
def test_batch_shapes(
    name: str,
    head_dim: int,
    dtype: torch.dtype,
    paged_batch: Callable[..., object],
    assert_close: Callable[..., None],
) -> None:
    batch = paged_batch(
        BATCHES[name], num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype
    )
    out, ref = run_both(batch)
    assert_close(out, ref)


@pytest.mark.parametrize(
    ("name", "num_splits"), (("decode", 2), ("decode", 3), ("decode", 8), ("mixed", 3))
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_matches_reference(
    name: str,
    num_splits: int,
    dtype: torch.dtype,
    paged_batch: Callable[..., object],
    assert_close: Callable[..., None],
) -> None:
    # 8 splits over a 99-token context leave some splits empty: they must weigh nothing.
    batch = paged_batch(
        BATCHES[name], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype
    )
    out, ref = run_both(batch, num_splits=num_splits, tile_n=16)
    assert_close(out, ref)


@pytest.mark.parametrize(("block_size", "tile_n"), ((64, 16), (16, 64), (32, 32)))
def test_tile_size_independent_of_block_size(
    block_size: int,
    tile_n: int,
    paged_batch: Callable[..., object],
    assert_close: Callable[..., None],
) -> None:
    batch = paged_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=torch.float32
    )
    out, ref = run_both(batch, tile_n=tile_n)
    assert_close(out, ref)


def test_odd_head_dim_is_padded(
    paged_batch: Callable[..., object], assert_close: Callable[..., None]
) -> None:
    batch = paged_batch(
        MIXED[:3], num_heads=4, num_kv_heads=2, head_dim=48, block_size=16, dtype=torch.float32
    )
    out, ref = run_both(batch)
    assert_close(out, ref)


def test_writes_into_given_output_and_reads_strided_query(
    paged_batch: Callable[..., object], assert_close: Callable[..., None]
) -> None:
    batch = paged_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    # The query as the model produces it: a slice of the fused qkv projection.
    qkv = torch.randn(batch.query.shape[0], 8, 64)
    qkv[:, :4] = batch.query
    query = qkv[:, :4]
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(query, batch.k_cache, batch.v_cache, batch.meta, 0.125, out=out)
    assert result is out
    assert_close(out, reference(batch, 0.125))


def test_rejects_inconsistent_inputs(paged_batch: Callable[..., object]) -> None:
    batch = paged_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(batch.query[:, :3], batch.k_cache, batch.v_cache, batch.meta, 0.125)
    with pytest.raises(ValueError, match="k_cache and v_cache both in its dtype"):
        paged_attention(batch.query.half(), batch.k_cache, batch.v_cache, batch.meta, 0.125)
    with pytest.raises(ValueError, match="tokens, the metadata"):
        paged_attention(batch.query[:-1], batch.k_cache, batch.v_cache, batch.meta, 0.125)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125, num_splits=0)
    with pytest.raises(ValueError, match="tile_n"):
        paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125, tile_n=24)


@pytest.mark.parametrize(
    ("num_programs", "max_seq_len", "expected"),
    (
        (132, 32768, 1),  # the batch alone fills an H100's 132 SMs
        (8, 100, 1),  # too short to split
        (8, 32768, 32),  # one sequence, 8 KV heads, long context: capped at MAX_SPLITS
        (64, 4096, 5),  # ceil(2 * 132 / 64) = 5 waves' worth
        (16, 1024, 4),  # 1024 // (4 * 64): at least 4 tiles per split
    ),
)
def test_choose_num_splits(num_programs: int, max_seq_len: int, expected: int) -> None:
    assert choose_num_splits(num_programs, max_seq_len, 64, 132) == expected


def test_backend_runs_the_kernel_and_falls_back_without_interpreter(
    paged_batch: Callable[..., object], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpilot.engine.attention import get_attention_backend
    from kvpilot.engine.kernels.runtime import TritonKernel

    backend = get_attention_backend("triton")
    assert backend.name == "triton"
    batch = paged_batch(
        MIXED, num_heads=6, num_kv_heads=2, head_dim=64, block_size=32, dtype=torch.float32
    )
    launched: list[str] = []
    original = TritonKernel.on

    def spy(self: TritonKernel, device: torch.device) -> object:
        launched.append(self.__name__)
        return original(self, device)

    monkeypatch.setattr(TritonKernel, "on", spy)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    ref = paged_attention_reference(*args)
    torch.testing.assert_close(backend.forward(*args), ref, atol=1e-5, rtol=1.3e-6)
    # A mixed batch: a pass over its decodes, one over its chunks.
    assert launched == ["_paged_attention_kernel"] * 2
    monkeypatch.delenv("TRITON_INTERPRET")
    assert torch.equal(backend.forward(*args), ref)  # the torch reference itself
    assert launched == ["_paged_attention_kernel"] * 2
