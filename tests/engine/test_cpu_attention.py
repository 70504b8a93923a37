"""The 'cpu' attention backend (C decode kernel, C varlen kernel for steps with prefill chunks)
against the torch reference on the same paged cache.

The reference runs in float32 on float32 copies of the inputs, so it is the exact answer up to
float32 rounding; the kernel accumulates in float32 whatever the storage dtype.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.engine.attention import get_attention_backend
from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.attention.torch_ref import paged_attention_reference
from kvpilot.engine.cpu.attention_backend import (
    CpuAttentionBackend,
    is_supported,
    paged_attention,
    paged_decode,
)
from kvpilot.engine.cpu.build import load_library

LIB = load_library()
needs_kernel = pytest.mark.skipif(LIB is None, reason="no C compiler to build the CPU kernel")

# Tolerances on the attention output (values are O(1)): float32 accumulates in a different order
# than the reference; bfloat16 adds one rounding of the output and of the stored inputs.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random paged cache whose blocks are scattered over the pool, and queries for it."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, cursor = [], 0
    for n in blocks_per_seq:
        tables.append(order[cursor : cursor + n])
        cursor += n
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
    return query, k_cache, v_cache, meta


def reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    return paged_attention_reference(query.float(), k_cache.float(), v_cache.float(), meta, scale)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    # Every path of the kernel's inner loops: four keys at a time (group <= 4) or one, the P.V
    # accumulators in registers (group x head_dim / 16 <= 16) or one 16-dim slice at a time.
    [(9, 3, 64, 16), (4, 4, 64, 32), (8, 2, 128, 16), (16, 1, 32, 8), (8, 1, 32, 16)],
)
def test_decode_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    rng = random.Random(1)
    # Lengths from 1 token through several blocks, past one score chunk (512) and not
    # block-aligned.
    seq_lens = [1, 2, block_size, block_size + 1, 77, 300, 513, 1100] + [
        rng.randint(1, 400) for _ in range(8)
    ]
    query, k_cache, v_cache, meta = make_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    assert is_supported(query, k_cache, v_cache)
    out = paged_decode(LIB, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(
        out.float(), reference(query, k_cache, v_cache, meta, scale), atol=ATOL[dtype], rtol=0
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_path_without_avx512(dtype: torch.dtype) -> None:
    """The plain-C loops that machines without AVX-512 run, built here with -mno-avx512f."""
    portable = load_library(("-mno-avx512f",))
    assert portable is not None and portable is not LIB
    seq_lens = [1, 16, 17, 300, 700]
    query, k_cache, v_cache, meta = make_batch([1] * 5, seq_lens, 9, 3, 64, 16, dtype)
    out = paged_decode(portable, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(
        out.float(), reference(query, k_cache, v_cache, meta, 0.125), atol=ATOL[dtype], rtol=0
    )


@needs_kernel
@pytest.mark.parametrize("block_size", [8, 32])
def test_prefetch_changes_no_bits(block_size: int) -> None:
    """The decode's software prefetch (a window of blocks ahead, past one score chunk here) only
    asks for memory early: the same bits as a build without it."""
    plain = load_library(("-DKVPILOT_NO_PREFETCH",))
    assert plain is not None and plain is not LIB
    seq_lens = [1, block_size, block_size + 1, 300, 1100]
    query, k_cache, v_cache, meta = make_batch(
        [1] * 5, seq_lens, 9, 3, 64, block_size, torch.bfloat16
    )
    outs = [
        paged_decode(lib, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125)
        for lib in (LIB, plain)
    ]
    assert torch.equal(outs[0], outs[1])


@needs_kernel
def test_kernels_share_torchs_thread_setting() -> None:
    """Built with OpenMP, the library uses the libgomp torch loaded: torch.set_num_threads
    reaches it."""
    before = torch.get_num_threads()
    try:
        seen = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            seen.append(LIB.kvpilot_openmp_threads())
    finally:
        torch.set_num_threads(before)
    if seen == [1, 1]:
        pytest.skip("the library was built without OpenMP")
    assert seen == [1, 2]


@needs_kernel
def test_empty_context_gives_zeros_not_nan() -> None:
    query, k_cache, v_cache, meta = make_batch([1, 1], [5, 9], 4, 2, 64, 16, torch.float32)
    lens = torch.tensor([0, 9], dtype=torch.int32)
    out = paged_decode(LIB, query, k_cache, v_cache, meta.block_tables, lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out[1]).all()


@needs_kernel
def test_large_scores_stay_finite() -> None:
    """Scores far from zero (a spiky query): the softmax must subtract the running max."""
    query, k_cache, v_cache, meta = make_batch([1, 1], [40, 700], 4, 2, 64, 16, torch.float32)
    query = query * 60.0
    out = paged_decode(LIB, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out, reference(query, k_cache, v_cache, meta, 0.125), atol=1e-4, rtol=1e-4
    )


def random_step(rng: random.Random, num_seqs: int, block_size: int) -> tuple[list[int], list[int]]:
    """(query lengths, context lengths) of a mixed step: fresh prefills, chunks over a cached
    prefix (starting mid-block), decodes; lengths 1..300, most not block-aligned."""
    query_lens, seq_lens = [], []
    for i in range(num_seqs):
        kind = i % 3
        if kind == 0:  # a whole prompt
            q_len = rng.randint(2, 300)
            prefix = 0
        elif kind == 1:  # a chunk after a cached prefix
            q_len = rng.randint(2, 150)
            prefix = rng.randint(1, 150)
        else:  # a decode
            q_len = 1
            prefix = rng.randint(0, 299)
        query_lens.append(q_len)
        seq_lens.append(prefix + q_len)
    # Edges: a chunk that ends exactly on a block boundary and one that crosses it by a token.
    query_lens += [block_size, block_size + 1, 3]
    seq_lens += [2 * block_size, 2 * block_size + 1, block_size + 2]
    return query_lens, seq_lens


# The varlen kernel against the float32 reference: float32 within 1e-5 (summation order only);
# bfloat16 within 1e-2 absolute + 1e-2 relative (the output's own bf16 rounding is up to 0.4%).
VARLEN_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 64, 32), (8, 2, 128, 16), (12, 3, 128, 32), (16, 4, 64, 32)],
)
def test_varlen_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """GQA ratios 1, 3 and 4 (and more rows per tile than one tile holds), head sizes 64 and 128,
    block sizes 16 and 32."""
    rng = random.Random(num_heads * 1000 + head_dim + block_size)
    query_lens, seq_lens = random_step(rng, 12, block_size)
    query, k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = paged_attention(LIB, query, k_cache, v_cache, meta, scale)
    assert out is not None and out.dtype == dtype and out.shape == query.shape
    atol, rtol = VARLEN_TOL[dtype]
    torch.testing.assert_close(
        out.float(), reference(query, k_cache, v_cache, meta, scale), atol=atol, rtol=rtol
    )


@needs_kernel
def test_varlen_matches_sdpa_on_one_long_prompt() -> None:
    """Against plain causal SDPA on the dense keys (no paging in the oracle at all): one prompt
    of 1000 tokens, several key chunks and many tiles."""
    query, k_cache, v_cache, meta = make_batch([1000], [1000], 8, 2, 64, 16, torch.float32)
    out = paged_attention(LIB, query, k_cache, v_cache, meta, 0.125)
    blocks = meta.block_tables[0].long()
    k = k_cache[blocks].reshape(-1, 2, 64)[:1000]
    v = v_cache[blocks].reshape(-1, 2, 64)[:1000]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=0.125,
        enable_gqa=True,
    )[0].transpose(0, 1)
    assert out is not None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_varlen_large_scores_stay_finite() -> None:
    """Spiky queries: the masked (future) keys must not leak into the running max or the sum."""
    query, k_cache, v_cache, meta = make_batch(
        [70, 1, 9], [70, 700, 600], 4, 2, 64, 16, torch.float32
    )
    query = query * 60.0
    out = paged_attention(LIB, query, k_cache, v_cache, meta, 0.125)
    assert out is not None and torch.isfinite(out).all()
    torch.testing.assert_close(
        out, reference(query, k_cache, v_cache, meta, 0.125), atol=1e-4, rtol=1e-4
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512bf16",)])
def test_varlen_other_instruction_sets(dtype: torch.dtype, flags: tuple[str, ...]) -> None:
    """The plain-C build (no AVX-512), and AVX-512 without its bf16 dot product (bfloat16 then
    converts to float32 and uses FMAs, like float32)."""
    portable = load_library(flags)
    assert portable is not None and portable is not LIB
    query_lens, seq_lens = random_step(random.Random(5), 6, 16)
    query, k_cache, v_cache, meta = make_batch(query_lens, seq_lens, 9, 3, 64, 16, dtype)
    out = paged_attention(portable, query, k_cache, v_cache, meta, 0.125)
    assert out is not None
    atol, rtol = VARLEN_TOL[dtype]
    torch.testing.assert_close(
        out.float(), reference(query, k_cache, v_cache, meta, 0.125), atol=atol, rtol=rtol
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("varlen_kernel", [True, False])
def test_backend_mixed_batch(dtype: torch.dtype, varlen_kernel: bool) -> None:
    """Prefill chunks (fresh and over a cached prefix) and decodes in one step, through the varlen
    kernel or (varlen_kernel off) the reference plus the decode kernel: the rows land where they
    belong."""
    query_lens = [1, 37, 1, 16, 1, 1]
    seq_lens = [120, 37, 5, 80, 260, 33]
    query, k_cache, v_cache, meta = make_batch(query_lens, seq_lens, 9, 3, 64, 16, dtype)
    backend = get_attention_backend("cpu")
    assert isinstance(backend, CpuAttentionBackend) and backend.lib is not None
    backend.varlen_kernel = varlen_kernel
    out = backend.forward(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(
        out.float(), reference(query, k_cache, v_cache, meta, 0.125), atol=ATOL[dtype], rtol=0
    )


def test_unsupported_shapes_fall_back_to_the_reference() -> None:
    """head_dim 40 is not a multiple of 16 and float16 has no kernel: same answers, via torch."""
    backend = get_attention_backend("cpu")
    for head_dim, dtype in [(40, torch.float32), (64, torch.float16)]:
        query, k_cache, v_cache, meta = make_batch(
            [1, 1, 9], [50, 3, 20], 4, 2, head_dim, 16, dtype
        )
        assert not is_supported(query, k_cache, v_cache)
        out = backend.forward(query, k_cache, v_cache, meta, 0.2)
        expected = paged_attention_reference(query, k_cache, v_cache, meta, 0.2)
        torch.testing.assert_close(out, expected)


def test_auto_backend_is_cpu_on_cpu() -> None:
    from kvpilot.engine.config import EngineConfig

    assert EngineConfig(device="cpu").resolved_attention_backend == "cpu"
    assert EngineConfig(device="cpu", attention_backend="torch").resolved_attention_backend == (
        "torch"
    )
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_auto_backend_is_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read without a GPU: the config only asks whether Triton can be imported."""
    import importlib.util

    from kvpilot.engine.config import EngineConfig

    config = EngineConfig(device="cuda")
    assert config.resolved_attention_backend == "triton"
    assert EngineConfig(device="cuda", attention_backend="torch").resolved_attention_backend == (
        "torch"
    )
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else real_find_spec(name, *a),
    )
    assert config.resolved_attention_backend == "torch"
