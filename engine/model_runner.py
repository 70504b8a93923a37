"""Everything on the device: the model, the KV pool, turning a scheduled batch into tensors, and
sampling."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
from kvpilot.engine.config import EngineConfig, ModelConfig
from kvpilot.engine.cuda_graphs import (
    StepGraphs,
    eager_steps_to_compile,
    eager_warmup_plan,
    graph_batch_sizes,
    mixed_token_sizes,
)
from kvpilot.engine.host_copy import to_device
from kvpilot.engine.kernels.runtime import compiled_variants, num_sms
from kvpilot.engine.model.cpu_linear import pack_linears, packing_available
from kvpilot.engine.model.layer_ops import LayerOps
from kvpilot.engine.model.llama import ForwardContext, LlamaForCausalLM
from kvpilot.engine.model.loader import (
    ResolvedModel,
    build_model,
    init_dummy_weights,
    load_safetensors_weights,
    model_size_gib,
)
from kvpilot.engine.parallel.group import TPGroup
from kvpilot.engine.sampler import (
    LaunchedSample,
    SampleResult,
    SamplerRow,
    launch_sample,
    resolve_sample,
)
from kvpilot.engine.scheduler import ScheduledSequence
from kvpilot.engine.step_input import CUDA_TABLE_WIDTH_MULTIPLE, StepInput, plan_step
from kvpilot.engine.structured.manager import StructuredOutputs

log = logging.getLogger("kvpilot")


@dataclass(frozen=True)
class PreparedBatch:
    input_ids: torch.Tensor  # [T]
    ctx: ForwardContext
    logits_indices: torch.Tensor  # [S_sample]: flat index of each sampling sequence's last token


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device: the sequences that sample, in order, and their draws."""

    sampling: list[ScheduledSequence]
    sample: LaunchedSample | None


@dataclass(frozen=True)
class PendingInputs:
    """Input tokens that are the previous step's samples, still on the device (async
    scheduling): flat token index in this step -> row of the previous step's draws."""

    token_indices: list[int]
    sample_rows: list[int]


def pending_inputs(scheduled: list[ScheduledSequence]) -> PendingInputs:
    """Where this step reads tokens the host does not know yet: a sequence's pending token is its
    last, so it is the last of its chunk."""
    indices, rows = [], []
    end = 0
    for item in scheduled:
        end += item.num_new_tokens
        if item.seq.pending_row is not None:
            indices.append(end - 1)
            rows.append(item.seq.pending_row)
    return PendingInputs(indices, rows)


class StepSink(Protocol):
    """The other tensor-parallel ranks, as rank 0's runner sees them (parallel.workers)."""

    def send(self, step: StepInput) -> None: ...

    def blame(self, error: BaseException) -> None: ...


def layer_ops_for(backend: str) -> LayerOps:
    if backend == "cpu":
        from kvpilot.engine.cpu.layer_ops import cpu_layer_ops

        return cpu_layer_ops()
    if backend != "triton":
        return LayerOps()
    from kvpilot.engine.kernels import get_layer_ops

    return get_layer_ops(backend)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        source: ResolvedModel,
        max_model_len: int,
        tp: TPGroup | None = None,
        workers: StepSink | None = None,
    ) -> None:
        """tp: this process's rank when the model is split (None: the whole model, no
        collective); workers: where rank 0 sends each step for the other ranks."""
        self.config = config
        self.model_config = model_config
        self.device = config.rank_device(0 if tp is None else tp.rank)
        self.dtype = config.resolved_dtype
        self.block_size = config.cache.block_size
        self.tp = tp
        self.workers = workers
        backend = get_attention_backend(config.resolved_attention_backend)
        self.model: LlamaForCausalLM = build_model(
            model_config,
            backend,
            max_model_len,
            self.device,
            self.dtype,
            layer_ops_for(backend.name),
            tp,
        )
        self.bytes_loaded = 0
        if source.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            self.bytes_loaded = load_safetensors_weights(self.model, source.hf_dir)
        self.rank_bytes_loaded = [self.bytes_loaded]  # every rank's, filled in by rank 0 under TP
        log.info(
            "model weights: %.2f GiB in %s on %s%s",
            model_size_gib(self.model),
            self.dtype,
            self.device,
            "" if tp is None else f" (tensor-parallel rank {tp.rank} of {tp.size})",
        )
        # After the size is logged: packed weights are buffers, not parameters.
        if self.device.type == "cpu":
            self._pack_cpu_linears(backend.name)
        self.num_blocks = self._decide_num_blocks()
        use_graphs = (
            self.device.type == "cuda"
            and backend.name == "triton"
            and tp is None
            and not config.enforce_eager
        )
        # The graphs' padded rows write and read one block past the block manager's: the null block.
        self.null_block = self.num_blocks if use_graphs else None
        shape = (
            self.num_blocks + (1 if use_graphs else 0),
            self.block_size,
            self.model.shard.num_kv_heads,
            model_config.head_dim,
        )
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_config.num_hidden_layers)
        ]  # fmt: skip
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block / 2**30,
        )
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._last_draws: torch.Tensor | None = None  # the last launched step's tokens [S]
        # CUDA block tables' row stride (a kernel argument) stays in one class: see plan_step.
        self.table_width_multiple = CUDA_TABLE_WIDTH_MULTIPLE if self.device.type == "cuda" else 1
        self.step_graphs: StepGraphs | None = None
        if self.null_block is not None:
            sched = config.scheduler
            self.step_graphs = StepGraphs(
                self.model,
                self.kv_caches,
                graph_batch_sizes(sched.max_num_seqs),
                mixed_token_sizes(sched.max_num_batched_tokens),
                sched.max_num_seqs,
                max_model_len,
                self.block_size,
                self.null_block,
            )
            self._compile_eager_variants()

    def _compile_eager_variants(self) -> None:
        """Runs once each kind of step no graph holds (more tokens than the largest mixed graph,
        more decodes than any graph), so the kernel variants they launch are compiled now and not
        while a request waits: on an H100, the first pass over a 1000-request workload compiled
        for ~2.5 s of its 22.8 s (bench/RESULTS.md)."""
        from kvpilot.engine.kernels import attention  # CUDA graphs imply Triton

        graphs = self.step_graphs
        assert graphs is not None
        sched = self.config.scheduler
        plan = eager_warmup_plan(
            graphs, sched.max_num_batched_tokens, sched.max_num_seqs, self.num_blocks
        )
        if plan is None:
            return
        num_tokens, decode_seqs = plan
        started = time.perf_counter()
        before = sum(compiled_variants().values())
        steps = eager_steps_to_compile(
            num_tokens, self.block_size, self.table_width_multiple, decode_seqs
        )
        for step in steps:
            if graphs.shape_for(step) is not None:
                raise AssertionError(f"a warm-up step of {num_tokens} tokens fits a graph")
            self.forward_step(step)
        # Those steps launch only some of the attention passes an eager step can: a split count
        # depends on the batch and its longest context. Every one of them, directly.
        cfg = self.model_config
        k_cache, v_cache = self.kv_caches[0]
        passes = attention.eager_passes(
            num_tokens,
            sched.max_num_seqs,
            graphs.max_model_len,
            cfg.num_key_value_heads,
            cfg.num_attention_heads // cfg.num_key_value_heads,
            cfg.head_dim,
            num_sms(self.device.index or 0),
        )
        attention.compile_passes(passes, cfg.num_attention_heads, k_cache, v_cache)
        torch.cuda.synchronize(self.device)
        log.info(
            "eager steps (%d tokens and more): %d kernel variants compiled in %.1f s",
            num_tokens,
            sum(compiled_variants().values()) - before,
            time.perf_counter() - started,
        )

    def _pack_cpu_linears(self, backend_name: str) -> None:
        """The 'cpu' backend's own linear kernel where the library has it for this dtype (faster
        than oneDNN at every batch size measured, bench/RESULTS.md), else oneDNN's packed
        linear; the other backends keep oneDNN's, or nn.Linear where this torch lacks it."""
        batch_hint = self.config.scheduler.max_num_seqs
        if backend_name == "cpu":
            from kvpilot.engine.cpu.build import load_library
            from kvpilot.engine.cpu.linear import use_kernel_linears

            kernel = use_kernel_linears(self.model, load_library(), self.dtype, batch_hint)
            if kernel:
                log.info("%d %s linear layers on kvpilot's CPU kernel", kernel, self.dtype)
                return
        if packing_available(self.dtype):
            packed = pack_linears(self.model, batch_hint=batch_hint)
            log.info("packed %d %s linear layers for oneDNN", packed, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """This rank's bytes of one block (the whole block without tensor parallelism)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        cfg = self.model_config
        per_token = 2 * cfg.num_hidden_layers * self.model.shard.num_kv_heads * cfg.head_dim
        return per_token * itemsize * self.block_size

    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if cache.kv_cache_bytes is not None:
            budget = cache.kv_cache_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of one full step; the weights are already resident.
            reserve = 0.05 * total + 2**30
            budget = int(cache.gpu_memory_utilization * total - (total - free) - reserve)
        else:
            budget = int(cache.kv_cache_gib * 2**30)
        if self.device.type == "cuda":
            # A GPU budget is each GPU's: it holds its rank's share of a block; the smallest GPU
            # budget decides.
            num_blocks = budget // self.bytes_per_block
            if self.tp is not None:
                num_blocks = self.tp.min_over_ranks(num_blocks, self.device)
        else:
            # The CPU budget is the host memory of the whole KV cache, over every rank (ranks
            # share the host): one block is one block on every rank, replicated KV heads counted
            # as many times as they are held.
            num_ranks = 1 if self.tp is None else self.tp.size
            num_blocks = max(0, budget // (num_ranks * self.bytes_per_block))
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: the budget of {budget / 2**30:.2f} GiB holds no block "
                f"of {self.bytes_per_block / 2**20:.1f} MiB (raise kv_cache_bytes, "
                f"kv_cache_gib or gpu_memory_utilization)"
            )
        return num_blocks

    def prepare(self, step: StepInput) -> PreparedBatch:
        dev = self.device

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, dev)

        query_start, seq_lens = step.query_start, step.seq_lens
        query_lens = tuple(b - a for a, b in itertools.pairwise(query_start))
        meta = AttentionMetadata(
            query_start_loc=tensor(query_start, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(step.block_tables, torch.int32),
            slot_mapping=tensor(step.slot_mapping, torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=tuple(seq_lens),
        )
        ctx = ForwardContext(tensor(step.positions, torch.int64), meta, self.kv_caches)
        return PreparedBatch(
            tensor(step.input_ids, torch.int64), ctx, tensor(step.logits_indices, torch.int64)
        )

    @torch.inference_mode()
    def launch(
        self, scheduled: list[ScheduledSequence], structured: StructuredOutputs | None = None
    ) -> LaunchedStep:
        """Queues one step's forward pass and sampling on the device; resolve() reads the tokens.
        Constrained sequences' token masks are filled by `structured` while the forward runs.
        Sequences with a pending token (pending_row set) read it from the previous launch's
        draws on the device."""
        step = plan_step(scheduled, self.block_size, self.table_width_multiple)
        pending = pending_inputs(scheduled)
        sampling = [item for item in scheduled if item.will_sample]
        grammars = [item.seq.grammar for item in sampling]
        masks = structured.start_masks(grammars) if structured is not None else None
        if self.workers is None:
            logits = self.forward_step(step, pending)
        else:
            if pending.token_indices:
                raise ValueError("async scheduling does not run with tensor parallelism")
            self.workers.send(step)
            try:
                logits = self.forward_step(step)
            except RuntimeError as exc:  # a collective failed: name the rank that died, if one did
                self.workers.blame(exc)
                raise
        if logits is None or not sampling:
            self._last_draws = None
            return LaunchedStep([], None)
        rows = [
            SamplerRow(
                item.seq.params,
                # Only the penalties read them: no copy of every row's tokens at every step.
                item.seq.output_token_ids if item.seq.params.has_penalties else [],
                item.seq.generator,
            )
            for item in sampling
        ]
        mask = masks.result() if masks is not None else None
        drawn = launch_sample(
            logits, rows, self.default_generator, mask, self.model.model.ops.argmax_rows
        )
        self._last_draws = drawn.token_ids
        return LaunchedStep(sampling, drawn)

    def resolve(self, launched: LaunchedStep) -> SampleResult:
        """The launched step's tokens on the host (waits for the device)."""
        if launched.sample is None:
            return SampleResult([], [])
        return resolve_sample(launched.sample)

    @torch.inference_mode()
    def forward_step(
        self, step: StepInput, pending: PendingInputs | None = None
    ) -> torch.Tensor | None:
        """The forward pass of one step: the sampling rows' logits [S_sample, vocab] (on tensor
        parallel rank 0; None on the others, and when nothing samples)."""
        graphs = self.step_graphs
        shape = graphs.shape_for(step) if graphs is not None else None
        if graphs is not None and shape is not None:
            graphs.load(step, shape)
            self._fill_pending(graphs.input_ids, pending)
            hidden = graphs.replay(step, shape)
            if not step.logits_indices:
                return None
            if not shape.decode:  # a decode graph's rows are its sampling rows, in order
                hidden = hidden[self._indices(step.logits_indices)]
            return self.model.compute_logits(hidden)
        batch = self.prepare(step)
        self._fill_pending(batch.input_ids, pending)
        hidden = self.model(batch.input_ids, batch.ctx)
        if not step.logits_indices:
            return None
        return self.model.compute_logits(hidden[batch.logits_indices])

    def _fill_pending(self, input_ids: torch.Tensor, pending: PendingInputs | None) -> None:
        if pending is None or not pending.token_indices:
            return
        if self._last_draws is None:
            raise RuntimeError("a pending input token, but the last step drew none")
        draws = self._last_draws[self._indices(pending.sample_rows)]
        input_ids.index_copy_(0, self._indices(pending.token_indices), draws)

    def _indices(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)
