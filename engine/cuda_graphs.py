"""Steps replayed as CUDA graphs: one graph per padded step shape, captured once at start.

A step of a small batch is a few hundred tiny kernel launches (every layer's norms, rotary, KV
write, attention, SiLU and four GEMMs) plus the Python that issues them; on an 8B model a step
of a few hundred tokens takes longer to launch (~19 ms on an H200's host) than to run. Replaying a
captured graph issues them all with one call, as vLLM and SGLang do. Two families of graphs:

- decode graphs, one per batch size (1, 2, 4, then every multiple of 8): one token per sequence,
  attention tiled one query token per program;
- mixed graphs, one per token count (16 ... 1024): prefill chunks and decodes together, as the
  scheduler forms them while requests arrive, attention tiled for prefill chunks. Each has room
  for as many sequences as it has tokens (at most max_num_seqs).

How a step fits a graph captured for a larger shape:
- padded tokens write their keys and values into the null block, one block of the KV cache that
  the block manager never hands out; in a decode graph they are sequences of length 1 living
  there; in a mixed graph the padded sequences hold no query token (their attention programs exit
  at once) and the padded tokens belong to none;
- every input lives in a static device buffer that each step overwrites in place (token ids,
  positions, slots, query starts, sequence lengths, block tables), and the graph's final hidden
  states land in one static buffer; the logits are computed outside the graph, on the sampling
  rows only (a per-shape [tokens, vocab] float32 output would cost gigabytes over all shapes);
- the attention kernel reads sequence lengths and query starts on the device and is launched for
  the longest possible sequence (max_model_len), so one graph serves every context length:
  split-K picks its split count from that bound, and splits past a sequence's end exit.

Graphs are captured from the most tokens down into one shared memory pool, so their temporaries
share memory: the pool holds about one largest step's activations. Nothing is ever captured while
serving; a step no graph holds (more tokens than the largest mixed graph) runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.host_copy import to_device
from kvpilot.engine.model.llama import ForwardContext, LlamaForCausalLM
from kvpilot.engine.step_input import CUDA_TABLE_WIDTH_MULTIPLE, StepInput, round_up

log = logging.getLogger("kvpilot")

# vLLM's default largest captured batch; larger decode batches are compute-bound anyway.
MAX_CAPTURE_SIZE = 512
# Past ~1k tokens a step of a model worth a GPU runs longer than its eager launch: no graph needed.
MAX_MIXED_CAPTURE_TOKENS = 1024


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """The decode graphs' sizes: 1, 2, 4, then multiples of 8 up to the first one >= the largest
    batch the scheduler can form (capped at `limit`)."""
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"max_num_seqs and limit must be >= 1, got {max_num_seqs}, {limit}")
    top = min(max_num_seqs, limit)
    sizes: list[int] = []
    for size in (1, 2, 4, *range(8, top + 8, 8)):
        sizes.append(size)
        if size >= top:
            break
    return tuple(sizes)


def mixed_token_sizes(
    max_num_batched_tokens: int, limit: int = MAX_MIXED_CAPTURE_TOKENS
) -> tuple[int, ...]:
    """The mixed graphs' token counts: every 16 up to 128, every 32 up to 256, every 64 up to
    512, every 128 after (padding wastes at most a quarter of a step), up to the first one >= the
    step token budget (capped at `limit`; 0 captures none)."""
    if max_num_batched_tokens < 1 or limit < 0:
        raise ValueError(
            f"max_num_batched_tokens must be >= 1 and limit >= 0, got {max_num_batched_tokens}, "
            f"{limit}"
        )
    top = min(max_num_batched_tokens, limit)
    sizes: list[int] = []
    candidates = (*range(16, 128, 16), *range(128, 256, 32), *range(256, 512, 64))
    size = 0
    for size in candidates:
        if size >= top:
            break
        sizes.append(size)
    else:
        size = 512
        while size < top:
            sizes.append(size)
            size += 128
    if top:
        sizes.append(size)
    return tuple(sizes)


def bucket_for(count: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `count` (None: larger than every graph)."""
    i = bisect.bisect_left(sizes, count)
    return sizes[i] if i < len(sizes) else None


def is_plain_decode(step: StepInput) -> bool:
    """One token per sequence, and every sequence samples in sequence order: the only shape a
    decode graph computes."""
    num_seqs = len(step.seq_lens)
    return (
        num_seqs > 0
        and len(step.input_ids) == num_seqs
        and step.logits_indices == list(range(num_seqs))
    )


def eager_steps_to_compile(
    num_tokens: int, block_size: int, table_width_multiple: int, decode_seqs: int = 0
) -> list[StepInput]:
    """Steps of num_tokens, too many for any graph, in the kinds the scheduler forms: a prompt
    chunk alone, the same chunk beside one decode (a mixed batch's two attention passes), and
    (decode_seqs > 0) that many decodes alone. Running each once compiles the kernel variants
    that eager steps launch, before any request could wait for a compile. They write keys into
    blocks 0..num_tokens / block_size: call it before the first request, when no block holds
    anything."""
    chunk_table = list(range(1, -(-num_tokens // block_size) + 1))  # block 0: the decodes'
    width = round_up(len(chunk_table), table_width_multiple)

    def row(table: list[int]) -> list[int]:
        return table + [0] * (width - len(table))

    def chunk_slots(length: int) -> list[int]:
        return [chunk_table[p // block_size] * block_size + p % block_size for p in range(length)]

    alone = StepInput(
        input_ids=[0] * num_tokens,
        positions=list(range(num_tokens)),
        slot_mapping=chunk_slots(num_tokens),
        query_start=[0, num_tokens],
        seq_lens=[num_tokens],
        block_tables=[row(chunk_table)],
        logits_indices=[num_tokens - 1],
    )
    chunk = num_tokens - 1
    beside_a_decode = StepInput(
        input_ids=[0] * num_tokens,
        positions=[0, *range(chunk)],
        slot_mapping=[0, *chunk_slots(chunk)],
        query_start=[0, 1, num_tokens],
        seq_lens=[1, chunk],
        block_tables=[row([0]), row(chunk_table)],
        logits_indices=[0, num_tokens - 1],
    )
    steps = [alone, beside_a_decode]
    if decode_seqs:
        steps.append(
            StepInput(
                input_ids=[0] * decode_seqs,
                positions=[0] * decode_seqs,
                slot_mapping=[0] * decode_seqs,
                query_start=list(range(decode_seqs + 1)),
                seq_lens=[1] * decode_seqs,
                block_tables=[row([0])] * decode_seqs,
                logits_indices=list(range(decode_seqs)),
            )
        )
    return steps


def eager_warmup_plan(
    graphs: StepGraphs, max_num_batched_tokens: int, max_num_seqs: int, num_blocks: int
) -> tuple[int, int] | None:
    """(tokens of the chunk steps, decodes of the decode-only step, 0 for none) for
    eager_steps_to_compile: the smallest steps of each kind no graph holds that the scheduler
    can form. None: every step fits a graph, or the pool cannot hold such a chunk."""
    largest = max(graphs.mixed_sizes, default=0)
    if max_num_batched_tokens <= largest:
        return None
    num_tokens = largest + 1
    if -(-num_tokens // graphs.block_size) + 1 > num_blocks:
        return None
    # Decodes alone run eagerly only past both kinds of graph (a mixed graph takes them too).
    decode_seqs = max(largest, max(graphs.decode_sizes, default=0)) + 1
    if decode_seqs > min(max_num_seqs, max_num_batched_tokens):
        decode_seqs = 0
    return num_tokens, decode_seqs


@dataclass(frozen=True)
class GraphShape:
    num_tokens: int
    num_seqs: int
    decode: bool  # one token per sequence; else a mixed step (prefill tiling, padded sequences)


@dataclass(frozen=True)
class PaddedStep:
    """A step's inputs padded to a graph's shape (host lists, copied into the static buffers)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # [num_seqs, width of the step's longest table]
    query_start: list[int] | None  # [num_seqs + 1]; None for a decode graph (always 0..num_seqs)


def pad_step(step: StepInput, shape: GraphShape, null_block: int, block_size: int) -> PaddedStep:
    """Pad a step to a graph's shape: padded tokens write into the null block; in a decode graph
    each is a length-1 sequence there, in a mixed graph the padded sequences hold no token."""
    num_tokens, num_seqs = len(step.input_ids), len(step.seq_lens)
    if num_tokens > shape.num_tokens or num_seqs > shape.num_seqs:
        raise ValueError(
            f"a step of {num_tokens} tokens in {num_seqs} sequences does not fit a graph of "
            f"{shape.num_tokens} tokens in {shape.num_seqs}"
        )
    if shape.decode and num_tokens != num_seqs:
        raise ValueError("a decode graph takes one token per sequence")
    pad_tokens, pad_seqs = shape.num_tokens - num_tokens, shape.num_seqs - num_seqs
    width = max(1, max((len(row) for row in step.block_tables), default=0))
    null_row = [null_block] + [0] * (width - 1)
    tables = [row + [0] * (width - len(row)) for row in step.block_tables]
    return PaddedStep(
        input_ids=step.input_ids + [0] * pad_tokens,
        positions=step.positions + [0] * pad_tokens,
        slot_mapping=step.slot_mapping + [null_block * block_size] * pad_tokens,
        seq_lens=step.seq_lens + [1 if shape.decode else 0] * pad_seqs,
        block_tables=tables + [null_row] * pad_seqs,
        query_start=None if shape.decode else step.query_start + [num_tokens] * pad_seqs,
    )


class StepGraphs:
    """Static input buffers, the per-shape graphs over them, and the replay of one step.

    capture=False runs the same padded, static-buffer forward eagerly: what the graphs record,
    checkable where there is no CUDA (the CPU tests run it under Triton's interpreter)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        decode_sizes: tuple[int, ...],
        mixed_sizes: tuple[int, ...],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        null_block: int,
        capture: bool = True,
    ) -> None:
        if not decode_sizes and not mixed_sizes:
            raise ValueError("at least one step shape to capture")
        self.model = model
        self.kv_caches = kv_caches
        self.decode_sizes = decode_sizes
        self.mixed_sizes = mixed_sizes
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.null_block = null_block
        # As wide as the widest table a CUDA step brings (plan_step rounds widths up).
        self.max_blocks_per_seq = round_up(
            -(-max_model_len // block_size), CUDA_TABLE_WIDTH_MULTIPLE
        )
        shapes = [GraphShape(n, n, True) for n in decode_sizes]
        shapes += [GraphShape(n, min(n, max_num_seqs), False) for n in mixed_sizes]
        self.shapes = tuple(shapes)
        device = kv_caches[0][0].device
        max_tokens = max(s.num_tokens for s in shapes)
        max_seqs = max(s.num_seqs for s in shapes)

        def ints(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = ints(max_tokens)
        self.positions = ints(max_tokens)
        self.slot_mapping = ints(max_tokens)
        self.seq_lens = ints(max_seqs, dtype=torch.int32)
        self.block_tables = ints(max_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        self.decode_query_start = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.query_start_loc = ints(max_seqs + 1, dtype=torch.int32)
        self.hidden = torch.zeros(
            max_tokens, model.config.hidden_size, dtype=kv_caches[0][0].dtype, device=device
        )
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps that replayed a graph (the tests check that graphs ran)
        self.mixed_replays = 0
        self.pool_bytes = 0
        self.capture_s = 0.0
        if capture:
            self._capture_all()

    def _metadata(self, shape: GraphShape) -> AttentionMetadata:
        # The host-side lengths are upper bounds: a graph serves every context length and chunk
        # length, and the kernels read the true ones from the device buffers.
        tokens, seqs = shape.num_tokens, shape.num_seqs
        if shape.decode:
            query_start, query_lens = self.decode_query_start[: seqs + 1], (1,) * seqs
        else:  # max_query_len > 1 picks the prefill tiling
            query_start = self.query_start_loc[: seqs + 1]
            query_lens = (tokens,) + (0,) * (seqs - 1)
        return AttentionMetadata(
            query_start_loc=query_start,
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            slot_mapping=self.slot_mapping[:tokens],
            max_query_len=max(query_lens),
            max_seq_len=self.max_model_len,
            query_lens_cpu=query_lens,
            seq_lens_cpu=(self.max_model_len,) * seqs,
        )

    def _forward(self, shape: GraphShape) -> None:
        n = shape.num_tokens
        ctx = ForwardContext(self.positions[:n], self._metadata(shape), self.kv_caches)
        self.hidden[:n].copy_(self.model(self.input_ids[:n], ctx))

    def _load(self, padded: PaddedStep) -> None:
        def put(buffer: torch.Tensor, values: list[int] | list[list[int]]) -> None:
            staged = to_device(values, buffer.dtype, buffer.device)
            buffer[tuple(slice(0, n) for n in staged.shape)].copy_(staged, non_blocking=True)

        put(self.input_ids, padded.input_ids)
        put(self.positions, padded.positions)
        put(self.slot_mapping, padded.slot_mapping)
        put(self.seq_lens, padded.seq_lens)
        put(self.block_tables, padded.block_tables)
        if padded.query_start is not None:
            put(self.query_start_loc, padded.query_start)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.hidden.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = None
        # Most tokens first: the smaller graphs reuse the largest one's memory.
        for shape in sorted(self.shapes, key=lambda s: (s.num_tokens, s.decode), reverse=True):
            nothing = StepInput([], [], [], [0], [], [], [])
            self._load(pad_step(nothing, shape, self.null_block, self.block_size))
            for _ in range(2):  # compiles every Triton variant this shape launches
                self._forward(shape)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(shape)
            pool = graph.pool()
            self.graphs[shape] = graph
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - start
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        log.info(
            "CUDA graphs: captured %d decode batch sizes (up to %d) and %d mixed step sizes "
            "(up to %d tokens) in %.1f s, %.0f MiB",
            len(self.decode_sizes),
            max(self.decode_sizes, default=0),
            len(self.mixed_sizes),
            max(self.mixed_sizes, default=0),
            self.capture_s,
            self.pool_bytes / 2**20,
        )

    def shape_for(self, step: StepInput) -> GraphShape | None:
        """The graph that runs this step (None: it runs eagerly)."""
        num_tokens, num_seqs = len(step.input_ids), len(step.seq_lens)
        if num_seqs == 0 or max(len(row) for row in step.block_tables) > self.max_blocks_per_seq:
            return None
        if is_plain_decode(step):
            size = bucket_for(num_seqs, self.decode_sizes)
            if size is not None:
                return GraphShape(size, size, True)
        tokens = bucket_for(num_tokens, self.mixed_sizes)
        if tokens is None or num_seqs > min(tokens, self.max_num_seqs):
            return None
        return GraphShape(tokens, min(tokens, self.max_num_seqs), False)

    def load(self, step: StepInput, shape: GraphShape) -> None:
        """Copies the step's inputs, padded to the shape, into the static buffers."""
        self._load(pad_step(step, shape, self.null_block, self.block_size))

    def replay(self, step: StepInput, shape: GraphShape) -> torch.Tensor:
        """Runs the loaded step: the final hidden states of its tokens [T, hidden] (a view of the
        static buffer, valid until the next step)."""
        graph = self.graphs.get(shape)
        if graph is None:
            self._forward(shape)
        else:
            graph.replay()
            self.replays += 1
            self.mixed_replays += not shape.decode
        return self.hidden[: len(step.input_ids)]
