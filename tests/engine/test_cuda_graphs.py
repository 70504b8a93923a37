"""The step-graph plumbing that needs no CUDA: the captured shapes, bucketing, which graph runs a
step, the padding into the null block, and the padded static-buffer forward (what a graph
records) against the plain eager forward for decode and mixed steps, under Triton's interpreter.
Capture and replay on a GPU: tests/kernels/test_gpu_kernels.py."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.config import ModelConfig
from kvpilot.engine.cuda_graphs import (
    GraphShape,
    StepGraphs,
    bucket_for,
    eager_steps_to_compile,
    eager_warmup_plan,
    graph_batch_sizes,
    is_plain_decode,
    mixed_token_sizes,
    pad_step,
)
from kvpilot.engine.kernels import get_layer_ops
from kvpilot.engine.kernels.attention_backend import TritonAttentionBackend
from kvpilot.engine.model.llama import ForwardContext
from kvpilot.engine.model.loader import build_model, init_dummy_weights
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import ScheduledSequence
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.step_input import StepInput, plan_step


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


@pytest.mark.parametrize(
    ("budget", "limit", "expected"),
    [
        (1, 1024, (16,)),
        (16, 1024, (16,)),
        (17, 1024, (16, 32)),
        (128, 1024, (*range(16, 129, 16),)),
        (300, 1024, (*range(16, 128, 16), *range(128, 256, 32), 256, 320)),
        (
            8192,
            1024,
            (
                *range(16, 128, 16),
                *range(128, 256, 32),
                *range(256, 512, 64),
                *range(512, 1025, 128),
            ),
        ),
        (8192, 600, (*range(16, 128, 16), *range(128, 256, 32), *range(256, 512, 64), 512, 640)),
        (8192, 0, ()),
    ],
)
def test_mixed_token_sizes(budget: int, limit: int, expected: tuple[int, ...]) -> None:
    assert mixed_token_sizes(budget, limit) == expected


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
    not_all_sample = msgspec.structs.replace(step, logits_indices=[0, 2])
    assert not is_plain_decode(not_all_sample)
    assert not is_plain_decode(StepInput([], [], [], [0], [], [], []))


def mixed_step(block_size: int = 4) -> StepInput:
    # A 5-token chunk of a sequence with 3 tokens already cached (it samples), then two decodes
    # (lengths 6 and 2).
    tables = [[1, 4], [5, 2], [8]]
    chunk_positions = [3, 4, 5, 6, 7]
    positions = [*chunk_positions, 5, 1]
    rows = [0] * 5 + [1, 2]
    slots = [tables[r][p // block_size] * block_size + p % block_size
             for r, p in zip(rows, positions, strict=True)]  # fmt: skip
    padded_tables = [t + [0] * (2 - len(t)) for t in tables]
    return StepInput([21, 22, 23, 24, 25, 31, 41], positions, slots, [0, 5, 6, 7], [8, 6, 2],
                     padded_tables, [4, 5, 6])  # fmt: skip


def test_pad_step_decode_fills_rows_with_null_block_sequences() -> None:
    padded = pad_step(decode_step(), GraphShape(8, 8, True), null_block=9, block_size=4)
    assert padded.input_ids == [11, 12, 13] + [0] * 5
    assert padded.positions == [5, 8, 0] + [0] * 5
    assert padded.slot_mapping == [2 * 4 + 1, 3 * 4 + 0, 6 * 4 + 0] + [36] * 5
    assert padded.seq_lens == [6, 9, 1] + [1] * 5
    assert padded.block_tables == [[5, 2, 0], [0, 7, 3], [6, 0, 0]] + [[9, 0, 0]] * 5
    assert padded.query_start is None
    with pytest.raises(ValueError, match="does not fit"):
        pad_step(decode_step(), GraphShape(2, 2, True), null_block=9, block_size=4)
    nothing = StepInput([], [], [], [0], [], [], [])
    empty = pad_step(nothing, GraphShape(2, 2, True), null_block=9, block_size=4)
    assert empty.block_tables == [[9], [9]] and empty.seq_lens == [1, 1]
    with pytest.raises(ValueError, match="one token per sequence"):
        pad_step(mixed_step(), GraphShape(8, 8, True), null_block=9, block_size=4)


def test_pad_step_mixed_gives_padded_tokens_to_no_sequence() -> None:
    step = mixed_step()
    padded = pad_step(step, GraphShape(16, 5, False), null_block=9, block_size=4)
    assert padded.input_ids == step.input_ids + [0] * 9
    assert padded.positions == step.positions + [0] * 9
    assert padded.slot_mapping == step.slot_mapping + [36] * 9
    # Padded sequences: no query token (they start where the real tokens end), length 0.
    assert padded.query_start == [0, 5, 6, 7, 7, 7]
    assert padded.seq_lens == [8, 6, 2, 0, 0]
    assert padded.block_tables == [[1, 4], [5, 2], [8, 0], [9, 0], [9, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        pad_step(step, GraphShape(16, 2, False), null_block=9, block_size=4)
    with pytest.raises(ValueError, match="does not fit"):
        pad_step(step, GraphShape(6, 6, False), null_block=9, block_size=4)


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


def metadata_of(step: StepInput) -> AttentionMetadata:
    query_lens = tuple(b - a for a, b in zip(step.query_start, step.query_start[1:], strict=False))
    return AttentionMetadata(
        query_start_loc=torch.tensor(step.query_start, dtype=torch.int32),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(step.block_tables, dtype=torch.int32),
        slot_mapping=torch.tensor(step.slot_mapping),
        max_query_len=max(query_lens),
        max_seq_len=max(step.seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=tuple(step.seq_lens),
    )


# A mixed graph's padded tokens belong to no sequence, so no attention program writes their rows:
# whatever the buffer held flows through those rows only (the interpreter warns of overflows).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_padded_static_forward_matches_eager(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's forward (padded tokens in the null block, static buffers, max_model_len as the
    length bound, a mixed graph's sequences without tokens) gives the eager forward's hidden
    states for the real tokens and writes the real slots only: the KV cache outside the null block
    ends up identical."""
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
    step = decode_step(block_size) if kind == "decode" else mixed_step(block_size)

    with torch.inference_mode():
        ctx = ForwardContext(torch.tensor(step.positions), metadata_of(step), eager_caches)
        expected = model(torch.tensor(step.input_ids), ctx)
        graphs = StepGraphs(model, caches, (1, 2, 4, 8), (16,), 4, max_model_len, block_size,
                            null_block=num_blocks, capture=False)  # fmt: skip
        graph_shape = graphs.shape_for(step)
        assert graph_shape == (GraphShape(4, 4, True) if kind == "decode"
                               else GraphShape(16, 4, False))  # fmt: skip
        graphs.load(step, graph_shape)
        actual = graphs.replay(step, graph_shape)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    written = torch.tensor(step.slot_mapping)
    untouched = torch.ones((num_blocks + 1) * block_size, dtype=torch.bool)
    untouched[written] = False
    untouched[num_blocks * block_size :] = False  # the null block: the padded tokens write there
    for (k, v), (k_ref, v_ref) in zip(caches, eager_caches, strict=True):
        for new, ref in ((k, k_ref), (v, v_ref)):
            flat, flat_ref = new.flatten(0, 1), ref.flatten(0, 1)
            # Slots nobody wrote are bit for bit the same; the real slots hold the same keys up
            # to the rounding of matmuls over other row counts.
            assert torch.equal(flat[untouched], flat_ref[untouched])
            torch.testing.assert_close(flat[written], flat_ref[written], rtol=1e-5, atol=1e-5)
        assert not torch.equal(k[num_blocks], k_ref[num_blocks])


def test_shape_for_picks_the_graph_or_none() -> None:
    model = build_model(TINY, TritonAttentionBackend(), 12, torch.device("cpu"), torch.float32)
    shape = (10, 4, TINY.num_key_value_heads, TINY.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(TINY.num_hidden_layers)]
    graphs = StepGraphs(model, caches, (1, 2, 4), (16, 32), 6, 12, 4, null_block=9, capture=False)
    assert graphs.shape_for(decode_step()) == GraphShape(4, 4, True)
    two_blocks = StepInput([1], [4], [8], [0, 1], [5], [[1, 2]], [0])
    assert graphs.shape_for(two_blocks) == GraphShape(1, 1, True)
    # max_model_len's three blocks per sequence, rounded up to the 16 a CUDA table's width is
    # rounded to (plan_step): 16 fit, 17 run eagerly.
    assert graphs.max_blocks_per_seq == 16
    sixteen = StepInput([1], [12], [8], [0, 1], [13], [[1, 2, 3, 4] + [0] * 12], [0])
    assert graphs.shape_for(sixteen) == GraphShape(1, 1, True)
    seventeen = StepInput([1], [12], [8], [0, 1], [13], [[1, 2, 3, 4] + [0] * 13], [0])
    assert graphs.shape_for(seventeen) is None
    # More decode rows than the largest decode graph: a mixed graph (room for max_num_seqs = 6).
    five = StepInput([1] * 5, [0] * 5, [0] * 5, list(range(6)), [1] * 5, [[0]] * 5, list(range(5)))
    assert graphs.shape_for(five) == GraphShape(16, 6, False)
    seven = StepInput([1] * 7, [0] * 7, [0] * 7, list(range(8)), [1] * 7, [[0]] * 7, list(range(7)))
    assert graphs.shape_for(seven) is None  # more sequences than any graph holds
    assert graphs.shape_for(mixed_step()) == GraphShape(16, 6, False)
    # A prefill chunk that does not sample, and one past the largest mixed graph.
    chunk = StepInput([1, 2, 3], [0, 1, 2], [0, 1, 2], [0, 3], [3], [[0]], [])
    assert graphs.shape_for(chunk) == GraphShape(16, 6, False)
    long = StepInput([1] * 33, list(range(33)), [0] * 33, [0, 33], [33], [[0]], [32])
    assert graphs.shape_for(long) is None
    assert graphs.shape_for(StepInput([], [], [], [0], [], [], [])) is None


def test_cuda_steps_round_block_table_widths_to_16() -> None:
    """An attention kernel argument is the tables' row stride: rounded up to 16 it stays in the
    one class Triton specializes a multiple of 16 to, whatever the step's longest table."""

    def scheduled(num_blocks: int, computed: int, new: int) -> ScheduledSequence:
        seq = Sequence("r", 0, list(range(computed + new)), computed + new, SamplingParams())
        seq.block_table = list(range(10, 10 + num_blocks))
        seq.num_computed_tokens = computed
        return ScheduledSequence(seq, new)

    batch = [scheduled(3, 40, 1), scheduled(17, 0, 5), scheduled(1, 0, 2)]
    plain = plan_step(batch, 16)
    assert [len(row) for row in plain.block_tables] == [17, 17, 17]
    for multiple, width in ((16, 32), (8, 24), (1, 17)):
        step = plan_step(batch, 16, multiple)
        assert [len(row) for row in step.block_tables] == [width] * 3
        for row, padded in zip(plain.block_tables, step.block_tables, strict=True):
            assert padded == row + [0] * (width - 17)
        assert step.slot_mapping == plain.slot_mapping and step.seq_lens == plain.seq_lens
    assert len(plan_step(batch[:1], 16, 16).block_tables[0]) == 16


def test_eager_steps_to_compile_are_steps_no_graph_holds() -> None:
    """The start-up steps that compile the eager kernel variants: each a consistent step (fresh
    chunks whose keys go to distinct slots of their own blocks), too big for every graph, and one
    the eager forward runs."""
    block_size, largest_mixed = 4, 32
    steps = eager_steps_to_compile(largest_mixed + 1, block_size, 16, decode_seqs=40)
    alone, mixed, decodes = steps
    assert len(alone.input_ids) == len(mixed.input_ids) == 33 and len(decodes.input_ids) == 40
    for step in steps:
        lens = [b - a for a, b in zip(step.query_start, step.query_start[1:], strict=False)]
        assert lens == step.seq_lens  # every sequence is fresh: its query is all of it
        assert all(len(row) % 16 == 0 for row in step.block_tables)
        assert step.logits_indices == [end - 1 for end in step.query_start[1:]]
    chunk_slots = mixed.slot_mapping[1:]
    assert len(set(chunk_slots)) == 32 and min(chunk_slots) >= block_size  # not the decode's
    assert sorted(alone.slot_mapping) == list(range(block_size, block_size + 33))
    assert mixed.seq_lens == [1, 32]

    model = build_model(TINY, TritonAttentionBackend(), 64, torch.device("cpu"), torch.float32)
    shape = (12, block_size, TINY.num_key_value_heads, TINY.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(TINY.num_hidden_layers)]
    graphs = StepGraphs(model, caches, graph_batch_sizes(32), mixed_token_sizes(largest_mixed),
                        32, 64, block_size, null_block=11, capture=False)  # fmt: skip
    assert max(graphs.mixed_sizes) == largest_mixed
    assert all(graphs.shape_for(step) is None for step in steps)
    init_dummy_weights(model, seed=1)
    for step in steps:
        ctx = ForwardContext(torch.tensor(step.positions), metadata_of(step), caches)
        hidden = model(torch.tensor(step.input_ids), ctx)
        assert hidden.shape == (len(step.input_ids), TINY.hidden_size)
        assert torch.isfinite(hidden).all()


@pytest.mark.parametrize(
    ("budget", "max_num_seqs", "expected"),
    (
        (64, 8, (33, 0)),  # chunks past the largest mixed graph (32); 8 decodes fit a graph
        (64, 48, (33, 33)),  # 33 decodes: past the decode graphs (8) and the mixed ones (32)
        (32, 48, None),  # every step fits a mixed graph
        (40, 40, (33, 33)),
    ),
)
def test_eager_warmup_plan_picks_the_smallest_steps_no_graph_holds(
    budget: int, max_num_seqs: int, expected: tuple[int, int] | None
) -> None:
    model = build_model(TINY, TritonAttentionBackend(), 64, torch.device("cpu"), torch.float32)
    shape = (12, 4, TINY.num_key_value_heads, TINY.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(TINY.num_hidden_layers)]
    graphs = StepGraphs(model, caches, graph_batch_sizes(8), mixed_token_sizes(32),
                        max_num_seqs, 64, 4, null_block=11, capture=False)  # fmt: skip
    plan = eager_warmup_plan(graphs, budget, max_num_seqs, num_blocks=11)
    assert plan == expected
    if plan is None:
        return
    num_tokens, decode_seqs = plan
    steps = eager_steps_to_compile(num_tokens, 4, 16, decode_seqs)
    assert all(graphs.shape_for(step) is None for step in steps)
    assert len(steps) == 2 + (decode_seqs > 0)
    # One token fewer, and each would have fit a graph.
    for smaller in eager_steps_to_compile(num_tokens - 1, 4, 16, max(0, decode_seqs - 1)):
        assert graphs.shape_for(smaller) is not None
    assert eager_warmup_plan(graphs, budget, max_num_seqs, num_blocks=8) is None  # 9 blocks
