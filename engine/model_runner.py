"""A step on the device: the scheduled batch turned into tensors, the forward pass (replayed from a
captured graph where one fits), and sampling. Building the model (model_setup.py), the KV pool
(kv_cache/) and the graphs (graph_capture.py) happen once, at construction."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.config import EngineConfig, ModelConfig
from kvpilot.engine.cuda_graphs import StepGraphs
from kvpilot.engine.graph_capture import (
    capture_step_graphs,
    compile_eager_variants,
    uses_step_graphs,
)
from kvpilot.engine.host_copy import to_device
from kvpilot.engine.kv_cache.pool import KVLayout, build_kv_pool
from kvpilot.engine.lora.adapter import LoRAAdapter, read_adapter
from kvpilot.engine.lora.ops import LoRAMapping, build_mapping
from kvpilot.engine.lora.slots import LoRASlots
from kvpilot.engine.model.llama import ForwardContext, LlamaForCausalLM
from kvpilot.engine.model.loader import ResolvedModel
from kvpilot.engine.model_setup import load_model
from kvpilot.engine.parallel.group import TPGroup
from kvpilot.engine.sampler import (
    LaunchedSample,
    SampleResult,
    SamplerRow,
    launch_sample,
    resolve_sample,
)
from kvpilot.engine.scheduler import ScheduledSequence
from kvpilot.engine.spec_decode.draft_model import draft_reserve
from kvpilot.engine.spec_decode.verify import Verified, VerifyRow, verify
from kvpilot.engine.step_input import CUDA_TABLE_WIDTH_MULTIPLE, StepInput, plan_step
from kvpilot.engine.structured.manager import StructuredOutputs

if TYPE_CHECKING:
    from kvpilot.engine.core.messages import SampledLogprobs


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
    # Sequences that verified proposals in this step, and per sequence its accepted proposals
    # and the token after them (read on the host already: speculation steps run in turn).
    speculated: list[ScheduledSequence] = field(default_factory=list)
    verified: list[list[int]] = field(default_factory=list)
    # Per speculating sequence, its tokens' logprobs when it asked for them.
    verified_logprobs: list[list[SampledLogprobs] | None] = field(default_factory=list)


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
    """The other tensor-parallel ranks, as rank 0's runner sees them (executor.workers)."""

    def send(self, step: StepInput) -> None: ...

    def blame(self, error: BaseException) -> None: ...


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
        loaded = load_model(config, model_config, source, max_model_len, self.device, tp)
        self.model: LlamaForCausalLM = loaded.model
        self.bytes_loaded = loaded.bytes_loaded
        self.rank_bytes_loaded = [self.bytes_loaded]  # every rank's, filled in by rank 0 under TP
        use_graphs = uses_step_graphs(
            config, self.device, loaded.backend_name, tensor_parallel=tp is not None
        )
        layout = KVLayout(
            model_config.num_hidden_layers,
            self.model.shard.num_kv_heads,
            model_config.head_dim,
            self.block_size,
        )
        draft = None
        if (
            self.device.type == "cuda"
            and config.speculative is not None
            and config.speculative.method == "draft_model"
        ):
            # The draft loads after this pool, on the same GPU: its share is left free.
            draft = draft_reserve(config, model_config, max_model_len)
        self.kv_pool = build_kv_pool(
            config, self.model, source, layout, self.dtype, self.device, tp,
            with_null_block=use_graphs, draft=draft,
        )  # fmt: skip
        self.lora_slots: LoRASlots | None = None
        if config.lora is not None:
            self.lora_slots = LoRASlots(
                self.model.model.layers,
                model_config,
                self.model.shard,
                config.lora.max_loras,
                config.lora.max_lora_rank,
                self.dtype,
                self.device,
            )
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._last_draws: torch.Tensor | None = None  # the last launched step's tokens [S]
        # CUDA block tables' row stride (a kernel argument) stays in one class: see plan_step.
        self.table_width_multiple = CUDA_TABLE_WIDTH_MULTIPLE if self.device.type == "cuda" else 1
        self.step_graphs: StepGraphs | None = None
        if use_graphs:
            self.step_graphs = capture_step_graphs(self.model, self.kv_pool, config, max_model_len)
            compile_eager_variants(
                self.step_graphs,
                self.forward_step,
                config,
                model_config,
                self.kv_pool,
                self.table_width_multiple,
            )

    @property
    def num_blocks(self) -> int:
        return self.kv_pool.num_blocks

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of every layer: the pool's."""
        return self.kv_pool.layers

    @property
    def bytes_per_block(self) -> int:
        """This rank's bytes of one block (the whole block without tensor parallelism)."""
        return self.kv_pool.bytes_per_block

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
        ctx = ForwardContext(
            tensor(step.positions, torch.int64), meta, self.kv_caches, self._lora_mapping(step),
            self.kv_pool.scales,
        )  # fmt: skip
        return PreparedBatch(
            tensor(step.input_ids, torch.int64), ctx, tensor(step.logits_indices, torch.int64)
        )

    def _lora_mapping(self, step: StepInput) -> LoRAMapping | None:
        """Each token's adapter slot, from its sequence's (None: no token has one)."""
        if not step.lora_slots:
            return None
        token_slots: list[int] = []
        for slot, start, end in zip(
            step.lora_slots, step.query_start, step.query_start[1:], strict=False
        ):
            token_slots.extend([slot] * (end - start))
        mapping = build_mapping(token_slots, self.device)
        return mapping if mapping.has_adapters else None

    def fill_lora_slots(self, fills: list[tuple[int, LoRAAdapter]]) -> None:
        """Copies adapters into their slots (before the step that first uses them)."""
        assert self.lora_slots is not None
        for slot, adapter in fills:
            self.lora_slots.load(slot, adapter)

    def fill_lora_slots_from_files(self, fills: list[tuple[int, str, str]]) -> None:
        """The other tensor-parallel ranks' fills: each reads the adapter itself."""
        lora = self.config.lora
        assert lora is not None
        self.fill_lora_slots(
            [
                (slot, read_adapter(name, path, self.model_config, lora.max_lora_rank))
                for slot, name, path in fills
            ]
        )

    @torch.inference_mode()
    def launch(
        self,
        scheduled: list[ScheduledSequence],
        structured: StructuredOutputs | None = None,
        lora_fills: list[tuple[int, LoRAAdapter]] | None = None,
    ) -> LaunchedStep:
        """Queues one step's forward pass and sampling on the device; resolve() reads the tokens.
        Constrained sequences' token masks are filled by `structured` while the forward runs.
        Sequences with a pending token (pending_row set) read it from the previous launch's
        draws on the device. lora_fills: adapter slots to fill first."""
        step = plan_step(scheduled, self.block_size, self.table_width_multiple)
        if lora_fills:
            self.fill_lora_slots(lora_fills)
            step.lora_fills = [(slot, a.name, a.path) for slot, a in lora_fills]
        pending = pending_inputs(scheduled)
        samplers = [item for item in scheduled if item.will_sample]  # in their logits rows' order
        sampling = [item for item in samplers if not item.num_spec_tokens]
        speculated = [item for item in samplers if item.num_spec_tokens]
        masks = None
        if structured is not None:
            masks = structured.start_masks(
                [item.seq.grammar for item in samplers],
                [item.seq.spec_token_ids[: item.num_spec_tokens] for item in samplers],
            )
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
        # Awaited even without logits: the mask walk must be done before a token is accepted.
        mask = masks.result() if masks is not None else None
        if logits is not None and mask is not None:
            mask.apply(logits)
        verified = Verified([], [])
        if logits is not None and speculated:
            logits, verified = self._verify(scheduled, logits)
        if logits is None or not sampling:
            self._last_draws = None
            return LaunchedStep([], None, speculated, verified.token_ids, verified.logprobs)
        rows = [
            SamplerRow(
                item.seq.params,
                # Only the penalties read them: no copy of every row's tokens at every step.
                item.seq.output_token_ids if item.seq.params.has_penalties else [],
                item.seq.generator,
            )
            for item in sampling
        ]
        drawn = launch_sample(
            logits, rows, self.default_generator, None, self.model.model.ops.argmax_rows
        )
        self._last_draws = drawn.token_ids
        return LaunchedStep(sampling, drawn, speculated, verified.token_ids, verified.logprobs)

    def _verify(
        self, scheduled: list[ScheduledSequence], logits: torch.Tensor
    ) -> tuple[torch.Tensor, Verified]:
        """Splits a step's logits rows: the plain sampling rows (returned, in order) and the
        speculating sequences' k+1 rows each, verified here (their tokens, in order)."""
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        seqs: list[VerifyRow] = []
        row = 0
        for item in scheduled:
            if not item.will_sample:
                continue
            if not item.num_spec_tokens:
                plain_rows.append(row)
                row += 1
                continue
            n = item.num_spec_tokens + 1
            spec_rows.extend(range(row, row + n))
            row += n
            seq = item.seq
            outputs = seq.output_token_ids if seq.params.has_penalties else []
            sampler_row = SamplerRow(seq.params, outputs, seq.generator)
            seqs.append(VerifyRow(sampler_row, seq.spec_token_ids[: item.num_spec_tokens]))
        verified = verify(
            logits[self._indices(spec_rows)],
            seqs,
            self.default_generator,
            self.model.model.ops.argmax_rows,
        )
        return logits[self._indices(plain_rows)], verified

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
        # Graphs hold no adapter: a step with adapter tokens runs eagerly.
        shape = graphs.shape_for(step) if graphs is not None and not step.lora_slots else None
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
