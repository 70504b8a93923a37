"""The decode-graph plumbing that needs no CUDA: the captured sizes, bucketing, which steps a graph
computes, the padding into the null block, and the padded static-buffer forward (what a graph
records) against the plain eager forward, under Triton's interpreter. Capture and replay on a GPU:
tests/kernels/test_gpu_kernels.py."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.config import ModelConfig
from kvpilot.engine.cuda_graphs import (
    DecodeGraphs,
    bucket_for,
    graph_batch_sizes,
    is_plain_decode,
    pad_decode,
)
from kvpilot.engine.kernels import get_layer_ops
from kvpilot.engine.kernels.attention_backend import TritonAttentionBackend
from kvpilot.engine.model.llama import ForwardContext
from kvpilot.engine.model.loader import build_model, init_dummy_weights
from kvpilot.engine.step_input import StepInput


@pytest.mark.parametrize(
    ("max_num_seqs", "limit", "expected"),
    [
        (1, 512, (1,)),
        (2, 512, (1, 2)),
        (3, 512, (1, 2, 4)),
        (8, 512, (1, 2, 4, 8)),
        (9, 512, (1, 2, 4, 8, 16)),
        (100, 512, (1, 2, 4, *range(8, 105, 8))),
        (256, 512, (1, 2, 4, *range(8, 257, 8))),
        (1024, 512, (1, 2, 4, *range(8, 513, 8))),
        (1024, 20, (1, 2, 4, 8, 16, 24)),
    ],
)
def test_graph_batch_sizes(max_num_seqs: int, limit: int, expected: tuple[int, ...]) -> None:
    assert graph_batch_sizes(max_num_seqs, limit) == expected


def test_graph_batch_sizes_rejects_nonpositive() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        graph_batch_sizes(0)


def test_bucket_for() -> None:
    sizes = (1, 2, 4, 8, 16)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert bucket_for(17, sizes) is None


def decode_step(block_size: int = 4) -> StepInput:
    # Three sequences of lengths 6, 9 and 1 decoding their last token.
    tables = [[5, 2], [0, 7, 3], [6]]
    seq_lens = [6, 9, 1]
    positions = [n - 1 for n in seq_lens]
    pairs = zip(tables, positions, strict=True)
    slots = [t[p // block_size] * block_size + p % block_size for t, p in pairs]
    padded_tables = [t + [0] * (3 - len(t)) for t in tables]
    return StepInput([11, 12, 13], positions, slots, [0, 1, 2, 3], seq_lens, padded_tables,
                     [0, 1, 2])  # fmt: skip


def test_is_plain_decode() -> None:
    step = decode_step()
    assert is_plain_decode(step)
    prefill = StepInput([1, 2, 3], [0, 1, 2], [0, 1, 2], [0, 3], [3], [[0]], [2])
    assert not is_plain_decode(prefill)
    not_all_sample = StepInput(
        *[getattr(step, f) for f in StepInput.__struct_fields__[:-1]], [0, 2]
    )
    assert not is_plain_decode(not_all_sample)
    assert not is_plain_decode(StepInput([], [], [], [0], [], [], []))


def test_pad_decode_fills_rows_with_null_block_sequences() -> None:
    padded = pad_decode(decode_step(), 8, null_block=9, block_size=4)
    assert padded.input_ids == [11, 12, 13] + [0] * 5
    assert padded.positions == [5, 8, 0] + [0] * 5
    assert padded.slot_mapping == [2 * 4 + 1, 3 * 4 + 0, 6 * 4 + 0] + [36] * 5
    assert padded.seq_lens == [6, 9, 1] + [1] * 5
    assert padded.block_tables == [[5, 2, 0], [0, 7, 3], [6, 0, 0]] + [[9, 0, 0]] * 5
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode(decode_step(), 2, null_block=9, block_size=4)
    empty = pad_decode(StepInput([], [], [], [0], [], [], []), 2, null_block=9, block_size=4)
    assert empty.block_tables == [[9], [9]] and empty.seq_lens == [1, 1]


TINY = ModelConfig(
    model_type="llama",
    vocab_size=64,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_bias=False,
)


def test_padded_static_forward_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's forward (padded rows in the null block, static buffers, max_model_len as the
    length bound) gives the eager forward's hidden states for the real rows and writes the real
    slots only: the KV cache outside the null block ends up identical."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    block_size, num_blocks, max_model_len = 4, 9, 32
    model = build_model(TINY, TritonAttentionBackend(), max_model_len, torch.device("cpu"),
                        torch.float32, get_layer_ops("triton"))  # fmt: skip
    init_dummy_weights(model, seed=3)
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks + 1, block_size, TINY.num_key_value_heads, TINY.head_dim)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
              for _ in range(TINY.num_hidden_layers)]  # fmt: skip
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    step = decode_step(block_size)

    meta = AttentionMetadata(
        query_start_loc=torch.tensor(step.query_start, dtype=torch.int32),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(step.block_tables, dtype=torch.int32),
        slot_mapping=torch.tensor(step.slot_mapping),
        max_query_len=1,
        max_seq_len=max(step.seq_lens),
        query_lens_cpu=(1, 1, 1),
        seq_lens_cpu=tuple(step.seq_lens),
    )
    with torch.inference_mode():
        ctx = ForwardContext(torch.tensor(step.positions), meta, eager_caches)
        expected = model(torch.tensor(step.input_ids), ctx)
        graphs = DecodeGraphs(model, caches, (1, 2, 4, 8), max_model_len, block_size,
                              null_block=num_blocks, capture=False)  # fmt: skip
        assert graphs.can_run(step)
        actual = graphs.run(step)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    written = torch.tensor(step.slot_mapping)
    untouched = torch.ones((num_blocks + 1) * block_size, dtype=torch.bool)
    untouched[written] = False
    untouched[num_blocks * block_size :] = False  # the null block: the padded rows write there
    for (k, v), (k_ref, v_ref) in zip(caches, eager_caches, strict=True):
        for new, ref in ((k, k_ref), (v, v_ref)):
            flat, flat_ref = new.flatten(0, 1), ref.flatten(0, 1)
            # Slots nobody wrote are bit for bit the same; the real slots hold the same keys up
            # to the rounding of a 3-row vs 4-row matmul.
            assert torch.equal(flat[untouched], flat_ref[untouched])
            torch.testing.assert_close(flat[written], flat_ref[written], rtol=1e-5, atol=1e-5)
        assert not torch.equal(k[num_blocks], k_ref[num_blocks])


def test_can_run_only_decode_steps_that_fit() -> None:
    model = build_model(TINY, TritonAttentionBackend(), 12, torch.device("cpu"), torch.float32)
    shape = (4, 4, TINY.num_key_value_heads, TINY.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(TINY.num_hidden_layers)]
    graphs = DecodeGraphs(model, caches, (1, 2, 4), 12, 4, null_block=3, capture=False)
    assert graphs.can_run(decode_step())
    two_blocks = StepInput([1], [4], [8], [0, 1], [5], [[1, 2]], [0])
    assert graphs.can_run(two_blocks)
    # Past max_model_len's three blocks per sequence, or more rows than the largest graph: eager.
    four_blocks = StepInput([1], [12], [8], [0, 1], [13], [[1, 2, 0, 0]], [0])
    assert not graphs.can_run(four_blocks)
    five = StepInput([1] * 5, [0] * 5, [0] * 5, list(range(6)), [1] * 5, [[0]] * 5, list(range(5)))
    assert not graphs.can_run(five)
    assert not graphs.can_run(StepInput([1, 2], [0, 1], [0, 1], [0, 2], [2], [[0]], [1]))
