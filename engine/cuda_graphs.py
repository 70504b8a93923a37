"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, captured once at start.

A decode step of a small batch is a few hundred tiny kernel launches (every layer's norms, rotary,
KV write, attention, SiLU and four GEMMs); at batch 1 on an 8B model the launches take longer than
the kernels. Replaying a captured graph issues them all with one call, as vLLM and SGLang do.

How the step fits a graph captured for another batch:
- the batch is padded up to the next captured size (1, 2, 4, then every multiple of 8); padded rows
  are sequences of length 1 whose only block is the null block, one block of the KV cache that the
  block manager never hands out, so their KV writes and attention reads touch nothing real;
- every input lives in a static device buffer that each step overwrites in place (token ids,
  positions, slots, sequence lengths, block tables), and the graph's final hidden states land in
  one static buffer; the logits are computed outside the graph, on the real rows only (a per-size
  [size, vocab] float32 output would cost gigabytes over all sizes);
- the attention kernel reads sequence lengths on the device and is launched for the longest
  possible sequence (max_model_len), so one graph serves every context length: split-K picks its
  split count from that bound, and splits past a sequence's end exit at once.

Graphs are captured from the largest size down into one shared memory pool, so their
temporaries share memory: the pool holds about one largest-batch step's activations. Nothing is
ever captured while serving.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.model.llama import ForwardContext, LlamaForCausalLM
from kvpilot.engine.step_input import StepInput

log = logging.getLogger("kvpilot")

# vLLM's default largest captured batch; larger decode batches are compute-bound anyway.
MAX_CAPTURE_SIZE = 512


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """The captured sizes: 1, 2, 4, then multiples of 8 up to the first one >= the largest batch
    the scheduler can form (capped at `limit`)."""
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"max_num_seqs and limit must be >= 1, got {max_num_seqs}, {limit}")
    top = min(max_num_seqs, limit)
    sizes: list[int] = []
    for size in (1, 2, 4, *range(8, top + 8, 8)):
        sizes.append(size)
        if size >= top:
            break
    return tuple(sizes)


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows (None: larger than every graph)."""
    i = bisect.bisect_left(sizes, num_seqs)
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


@dataclass(frozen=True)
class PaddedDecode:
    """A decode step's inputs padded to `size` rows (host lists, copied into the static buffers)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # [size, width of the step's longest table]


def pad_decode(step: StepInput, size: int, null_block: int, block_size: int) -> PaddedDecode:
    """Pad a plain decode step to `size` rows of length-1 sequences living in the null block."""
    num_seqs = len(step.seq_lens)
    if num_seqs > size:
        raise ValueError(f"a step of {num_seqs} sequences does not fit a graph of {size}")
    pad = size - num_seqs
    width = max(1, max((len(row) for row in step.block_tables), default=0))
    null_row = [null_block] + [0] * (width - 1)
    return PaddedDecode(
        input_ids=step.input_ids + [0] * pad,
        positions=step.positions + [0] * pad,
        slot_mapping=step.slot_mapping + [null_block * block_size] * pad,
        seq_lens=step.seq_lens + [1] * pad,
        block_tables=[row + [0] * (width - len(row)) for row in step.block_tables]
        + [null_row] * pad,
    )


class DecodeGraphs:
    """Static input buffers, the per-size graphs over them, and the replay of one step.

    capture=False runs the same padded, static-buffer forward eagerly: what the graphs record,
    checkable where there is no CUDA (the CPU tests run it under Triton's interpreter)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: tuple[int, ...],
        max_model_len: int,
        block_size: int,
        null_block: int,
        capture: bool = True,
    ) -> None:
        if not sizes:
            raise ValueError("at least one batch size to capture")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.null_block = null_block
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        device = kv_caches[0][0].device
        largest = sizes[-1]

        def ints(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = ints(largest)
        self.positions = ints(largest)
        self.slot_mapping = ints(largest)
        self.seq_lens = ints(largest, dtype=torch.int32)
        self.block_tables = ints(largest, self.max_blocks_per_seq, dtype=torch.int32)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(
            largest, model.config.hidden_size, dtype=kv_caches[0][0].dtype, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps that replayed a graph (the tests check that graphs ran)
        self.pool_bytes = 0
        self.capture_s = 0.0
        if capture:
            self._capture_all()

    def _metadata(self, size: int) -> AttentionMetadata:
        # The host-side lengths are upper bounds: a graph serves every context length, and the
        # kernels read the true lengths from seq_lens on the device.
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=(1,) * size,
            seq_lens_cpu=(self.max_model_len,) * size,
        )

    def _forward(self, size: int) -> None:
        ctx = ForwardContext(self.positions[:size], self._metadata(size), self.kv_caches)
        self.hidden[:size].copy_(self.model(self.input_ids[:size], ctx))

    def _load(self, padded: PaddedDecode) -> None:
        def put(buffer: torch.Tensor, values: list[int] | list[list[int]]) -> None:
            host = torch.tensor(values, dtype=buffer.dtype)
            buffer[tuple(slice(0, n) for n in host.shape)].copy_(host, non_blocking=True)

        put(self.input_ids, padded.input_ids)
        put(self.positions, padded.positions)
        put(self.slot_mapping, padded.slot_mapping)
        put(self.seq_lens, padded.seq_lens)
        put(self.block_tables, padded.block_tables)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.hidden.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            nothing = StepInput([], [], [], [0], [], [], [])
            self._load(pad_decode(nothing, size, self.null_block, self.block_size))
            for _ in range(2):  # compiles every Triton variant this size launches
                self._forward(size)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - start
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        log.info(
            "CUDA graphs: captured %d decode batch sizes (%d..%d) in %.1f s, %.0f MiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.capture_s,
            self.pool_bytes / 2**20,
        )

    def can_run(self, step: StepInput) -> bool:
        return (
            is_plain_decode(step)
            and len(step.seq_lens) <= self.sizes[-1]
            and max(len(row) for row in step.block_tables) <= self.max_blocks_per_seq
        )

    def run(self, step: StepInput) -> torch.Tensor:
        """The final hidden states of the step's rows [S, hidden] (a view of the static buffer,
        valid until the next step)."""
        num_seqs = len(step.seq_lens)
        size = bucket_for(num_seqs, self.sizes)
        assert size is not None, "can_run() first"
        self._load(pad_decode(step, size, self.null_block, self.block_size))
        graph = self.graphs.get(size)
        if graph is None:
            self._forward(size)
        else:
            graph.replay()
            self.replays += 1
        return self.hidden[:num_seqs]
