"""Everything on the device: the model, the KV pool, turning a scheduled batch into tensors, and
sampling."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
from kvpilot.engine.config import EngineConfig, ModelConfig, num_blocks_for_budget
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
from kvpilot.engine.sampler import SampleResult, SamplerRow, sample
from kvpilot.engine.scheduler import ScheduledSequence
from kvpilot.engine.structured.manager import StructuredOutputs

log = logging.getLogger("kvpilot")


@dataclass(frozen=True)
class PreparedBatch:
    input_ids: torch.Tensor  # [T]
    ctx: ForwardContext
    logits_indices: torch.Tensor  # [S_sample]: flat index of each sampling sequence's last token
    sampling: list[ScheduledSequence]


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
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = config.resolved_device
        self.dtype = config.resolved_dtype
        self.block_size = config.cache.block_size
        backend = get_attention_backend(config.resolved_attention_backend)
        self.model: LlamaForCausalLM = build_model(
            model_config,
            backend,
            max_model_len,
            self.device,
            self.dtype,
            layer_ops_for(backend.name),
        )
        if source.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_safetensors_weights(self.model, source.hf_dir)
        log.info(
            "model weights: %.2f GiB in %s on %s",
            model_size_gib(self.model),
            self.dtype,
            self.device,
        )
        # After the size is logged: packed weights are buffers oneDNN owns, not parameters.
        if self.device.type == "cpu" and packing_available(self.dtype):
            packed = pack_linears(self.model, batch_hint=config.scheduler.max_num_seqs)
            log.info("packed %d %s linear layers for oneDNN", packed, self.dtype)
        self.num_blocks = self._decide_num_blocks()
        shape = (
            self.num_blocks,
            self.block_size,
            model_config.num_key_value_heads,
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

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.model_config.kv_bytes_per_token * itemsize * self.block_size

    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of one full step; the weights are already resident.
            reserve = 0.05 * total + 2**30
            budget = int(cache.gpu_memory_utilization * total - (total - free) - reserve)
        else:
            budget = int(cache.kv_cache_gib * 2**30)
        num_blocks = num_blocks_for_budget(budget, self.model_config, self.block_size, self.dtype)
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: the budget of {budget / 2**30:.2f} GiB holds no block "
                f"of {self.bytes_per_block / 2**20:.1f} MiB (raise kv_cache_gib or "
                f"gpu_memory_utilization)"
            )
        return num_blocks

    def prepare(self, scheduled: list[ScheduledSequence]) -> PreparedBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[ScheduledSequence] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.will_sample:
                logits_indices.append(query_start[-1] - 1)
                sampling.append(item)
        max_blocks = max(len(item.seq.block_table) for item in scheduled)
        tables = [
            item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table))
            for item in scheduled
        ]
        dev = self.device

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        query_lens = tuple(b - a for a, b in itertools.pairwise(query_start))
        meta = AttentionMetadata(
            query_start_loc=tensor(query_start, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            slot_mapping=tensor(slots, torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=tuple(seq_lens),
        )
        ctx = ForwardContext(tensor(positions, torch.int64), meta, self.kv_caches)
        return PreparedBatch(
            tensor(input_ids, torch.int64), ctx, tensor(logits_indices, torch.int64), sampling
        )

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSequence], structured: StructuredOutputs | None = None
    ) -> tuple[list[ScheduledSequence], SampleResult]:
        """Runs one step. Returns the sequences that sampled, in order, and what they sampled.
        Constrained sequences' token masks are filled by `structured` while the forward runs."""
        batch = self.prepare(scheduled)
        grammars = [item.seq.grammar for item in batch.sampling]
        masks = structured.start_masks(grammars) if structured is not None else None
        hidden = self.model(batch.input_ids, batch.ctx)
        if not batch.sampling:
            return [], SampleResult([], [])
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows = [
            SamplerRow(item.seq.params, item.seq.output_token_ids, item.seq.generator)
            for item in batch.sampling
        ]
        if masks is None:
            return batch.sampling, sample(logits, rows, self.default_generator)
        return batch.sampling, sample(logits, rows, self.default_generator, masks.result())
