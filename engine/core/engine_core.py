"""The engine core: requests of token ids in, one token per running sequence per step out.

It owns the model runner (weights, KV pool, sampler), the block manager and the scheduler, and
decides what can be decided on token ids alone: EOS, stop token ids, max_tokens and the context
limit. Text (detokenization, stop strings, logprob strings) is the API side's business
(output_processor.py), which finishes a sequence early with `abort(request_id, index)`.

Not thread-safe: one thread owns a core.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot.contract import sizing
from kvpilot.engine.attention.kv_quant import kv_storage_dtype
from kvpilot.engine.config import EngineConfig, LoRAConfig, ModelConfig
from kvpilot.engine.core.fit import check_prompt_fits
from kvpilot.engine.core.load_threads import loading_threads
from kvpilot.engine.core.messages import (
    AddRequest,
    EngineStats,
    LoadLoRA,
    LoRAReply,
    ModelDescription,
    SeqUpdate,
    StepOutputs,
    UnloadLoRA,
)
from kvpilot.engine.cpu.heap import retain_freed_memory
from kvpilot.engine.executor.workers import TPWorkers
from kvpilot.engine.kv_cache.block_manager import BlockManager
from kvpilot.engine.lora.adapter import AdapterError, AdapterNotFound, LoRAAdapter, read_adapter
from kvpilot.engine.lora.manager import LoRAManager
from kvpilot.engine.memory_fit import check_memory_fit, memory_limit
from kvpilot.engine.model.loader import read_hf_config, resolve_model, set_offline_defaults
from kvpilot.engine.model_runner import LaunchedStep, ModelRunner
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import ScheduledSequence, Scheduler
from kvpilot.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from kvpilot.engine.spec_decode.draft_model import draft_bytes, draft_model_config
from kvpilot.engine.spec_decode.grammar import cut_to_grammar
from kvpilot.engine.spec_decode.policy import SpecDecodeCounters, SpeculationPolicy
from kvpilot.engine.spec_decode.proposer import build_proposer
from kvpilot.engine.structured.backend import resolve_backend
from kvpilot.engine.structured.manager import SequenceGrammar, StructuredOutputs

log = logging.getLogger("kvpilot")
# How long an idle step waits for a compiling grammar before it returns (and the step loop looks
# at its commands again).
GRAMMAR_POLL_S = 0.002


def check_prompt(
    prompt_token_ids: list[int], *, vocab_size: int, max_model_len: int, num_blocks: int,
    block_size: int,
) -> None:  # fmt: skip
    """Raise ValueError (a client error) unless this prompt can run: ids in the vocabulary, room
    for one generated token in the context and in the whole KV pool."""
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    check_prompt_fits(
        len(prompt_token_ids),
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=block_size,
    )


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError unless every logit_bias token id is in the vocabulary (an id past it
    would fail the whole batch's sampling step, not just this request)."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}); got {bad[0]}")


def cpu_memory_need(config: EngineConfig, model: ModelConfig) -> sizing.MemoryNeed:
    """What a CPU engine with this config holds in RAM at its peak, both processes together."""
    itemsize = torch.empty((), dtype=config.resolved_dtype).element_size()
    cache = config.cache
    kv_dtype = kv_storage_dtype(cache.kv_cache_dtype, config.resolved_dtype)
    kv_per_token = model.kv_bytes_per_token * torch.empty((), dtype=kv_dtype).element_size()
    if cache.num_blocks is not None:
        kv = cache.num_blocks * cache.block_size * kv_per_token
        kv_tokens = cache.num_blocks * cache.block_size
    else:
        kv = cache.kv_cache_bytes
        if kv is None:
            kv = int(cache.kv_cache_gib * 2**30)
        kv_tokens = sizing.kv_cache_tokens(
            kv_cache_bytes=kv, kv_bytes_per_token=kv_per_token, block_size=cache.block_size
        )
    need = sizing.cpu_memory_need(
        num_params=model.num_params,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        vocab_size=model.vocab_size,
        itemsize=itemsize,
        kv_cache_bytes=kv,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
    )
    if config.speculative is not None and config.speculative.method == "draft_model":
        need = dataclasses.replace(
            need, draft=draft_bytes(config, model, target_kv_tokens=kv_tokens)
        )
    if config.lora is None:
        return need
    return dataclasses.replace(need, adapters=adapter_bytes(config.lora, model, itemsize))


def adapter_bytes(lora: LoRAConfig, model: ModelConfig, itemsize: int) -> int:
    """The most this engine's adapters take: its slots and its host-memory LRU (contract)."""
    return sizing.lora_bytes(
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        q_size=model.num_attention_heads * model.head_dim,
        kv_size=model.num_key_value_heads * model.head_dim,
        intermediate_size=model.intermediate_size,
        max_rank=lora.max_lora_rank,
        max_loras=lora.max_loras,
        max_cpu_loras=lora.resolved_max_cpu_loras,
        itemsize=itemsize,
    )


@dataclass(frozen=True)
class StepInFlight:
    """A launched step whose tokens the host has not read yet."""

    scheduled: list[ScheduledSequence]
    launched: LaunchedStep
    first_scheduled: list[str]
    started: float

    @property
    def needs_host_tokens(self) -> bool:
        """A row whose next step reads its tokens on the host (a grammar's mask, the penalties):
        the next step waits for this one."""
        return any(
            item.seq.grammar is not None or item.seq.params.has_penalties
            for item in self.launched.sampling
        )


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        log_level: int = logging.INFO,
        on_model_files: Callable[[Path], None] | None = None,
    ) -> None:
        """on_model_files(hf_dir): called once the model's files are found, before the (long)
        load of its weights."""
        set_offline_defaults()
        self.config = config
        started = time.monotonic()
        log.info("loading model %s", config.model or "(bundled SmolLM2-135M-Instruct)")
        source = resolve_model(config.model, config.load_format)
        if on_model_files is not None:
            on_model_files(source.hf_dir)
        self.model_config = ModelConfig.from_hf_config(read_hf_config(source.hf_dir))
        if config.speculative is not None and config.speculative.method == "draft_model":
            # A draft of another vocabulary is refused before any weight is read.
            draft_model_config(config.speculative, self.model_config)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if config.resolved_device.type == "cpu":
            if config.retain_freed_memory:
                retain_freed_memory()
            # Before the weights and the KV cache are allocated: a clear error, not an OOM kill.
            check_memory_fit(cpu_memory_need(config, self.model_config), memory_limit())
        self.workers: TPWorkers | None = None
        if config.tensor_parallel_size == 1:
            with loading_threads(config.resolved_device):
                self.runner = ModelRunner(config, self.model_config, source, self.max_model_len)
        else:
            from kvpilot.engine.executor.launch import start_tensor_parallel

            self.runner, self.workers = start_tensor_parallel(
                config, self.model_config, source, self.max_model_len, log_level
            )
        self.block_size = config.cache.block_size
        self.num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(
            self.num_blocks, self.block_size, config.cache.enable_prefix_caching
        )
        self.lora: LoRAManager | None = None
        # LoadLoRA commands whose adapter is being read: (command, the read).
        self.lora_reads: list[tuple[LoadLoRA, Future[LoRAAdapter]]] = []
        if config.lora is not None:
            self.lora = self._start_adapters(config, config.served_model_name or source.name)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.lora)
        # A sequence can never outgrow the whole pool: it stops with "length" there instead of
        # hanging.
        self.max_seq_len = min(self.max_model_len, self.num_blocks * self.block_size)
        self.requests: dict[str, list[Sequence]] = {}
        self.speculation = (
            None
            if config.speculative is None
            else SpeculationPolicy(
                config.speculative,
                self.max_seq_len,
                build_proposer(
                    config,
                    self.model_config,
                    self.runner.device,
                    max_seq_len=self.max_seq_len,
                    target_pool_tokens=self.num_blocks * self.block_size,
                ),
            )
        )
        self.structured = StructuredOutputs(
            source.hf_dir,
            self.model_config.vocab_size,
            tuple(self.model_config.eos_token_ids),
            backend_name=resolve_backend(config.structured_outputs_backend),
            overlap=config.overlap_grammar_masks,
        )
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.async_scheduling = config.resolved_async_scheduling
        self.in_flight: StepInFlight | None = None
        self.description = ModelDescription(
            model_name=config.served_model_name or source.name,
            hf_dir=str(source.hf_dir),
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            eos_token_ids=tuple(self.model_config.eos_token_ids),
            tensor_parallel_size=config.tensor_parallel_size,
            grammar_backend=self.structured.backend_name,
            async_scheduling=self.async_scheduling,
            max_loras=0 if config.lora is None else config.lora.max_loras,
            max_lora_rank=0 if config.lora is None else config.lora.max_lora_rank,
            lora_modules=[] if self.lora is None else list(self.lora.paths.items()),
            max_num_seqs=config.scheduler.max_num_seqs,
            scheduling_policy=config.scheduler.policy,
            cache_dtype=config.cache.kv_cache_dtype,
            num_speculative_tokens=(
                0 if config.speculative is None else config.speculative.num_speculative_tokens
            ),
        )
        log.info(
            "engine core ready in %.1f s: %s%s",
            time.monotonic() - started,
            self.description.model_name,
            " (async scheduling)" if self.async_scheduling else "",
        )

    def _start_adapters(self, config: EngineConfig, model_name: str) -> LoRAManager:
        """The adapter book, with the --lora-modules adapters read now (a bad one fails the
        start, as vLLM's does: the operator loads adapters at run time instead)."""
        lora = config.lora
        assert lora is not None
        max_rank = lora.max_lora_rank

        def read(name: str, path: str) -> LoRAAdapter:
            return read_adapter(name, path, self.model_config, max_rank)

        manager = LoRAManager(lora, read)
        for name, path in lora.modules:
            if name == model_name:
                raise ValueError(f"the adapter name {name!r} is the served model's name")
            manager.add(read(name, path))
            log.info("LoRA adapter %s from %s", name, path)
        return manager

    # ---- adapters --------------------------------------------------------------------------------
    def load_lora(self, command: LoadLoRA) -> LoRAReply | None:
        """Starts reading the adapter (the reply comes from finished_lora_reads); a reply now
        when the command is refused at once."""
        if self.lora is None:
            return LoRAReply(
                command.command_id, 400, "LoRA is not enabled: start with --enable-lora"
            )
        if command.name == self.description.model_name:
            return LoRAReply(
                command.command_id, 400, f"the adapter name {command.name!r} is the model's name"
            )
        if command.replace and self._adapter_in_use(command.name):
            return LoRAReply(
                command.command_id,
                409,
                f"The lora adapter '{command.name}' is in use by requests; replace it once they "
                "finish.",
            )
        try:
            read = self.lora.read(command.name, command.path, replace=command.replace)
        except AdapterError as exc:
            return LoRAReply(command.command_id, 400, str(exc))
        self.lora_reads.append((command, read))
        return None

    def finished_lora_reads(self) -> list[LoRAReply]:
        """Registers the adapters read since the last call; the replies to their LoadLoRA."""
        if not self.lora_reads:
            return []
        assert self.lora is not None
        replies, still = [], []
        for command, read in self.lora_reads:
            if not read.done():
                still.append((command, read))
                continue
            error = read.exception()
            if error is None:
                if command.name in self.lora.paths and not command.replace:
                    message = f"The lora adapter '{command.name}' has already been loaded."
                    replies.append(LoRAReply(command.command_id, 400, message))
                    continue
                self.lora.add(read.result())
                log.info("LoRA adapter %s loaded from %s", command.name, command.path)
                replies.append(LoRAReply(command.command_id, 200, ""))
            else:
                status = 404 if isinstance(error, AdapterNotFound) else 400
                if not isinstance(error, AdapterError):
                    log.error("reading adapter %s failed", command.name, exc_info=error)
                replies.append(LoRAReply(command.command_id, status, str(error)))
        self.lora_reads = still
        return replies

    def unload_lora(self, command: UnloadLoRA) -> LoRAReply:
        if self.lora is None or command.name not in self.lora.paths:
            message = f"The lora adapter '{command.name}' cannot be found."
            return LoRAReply(command.command_id, 404, message)
        if self._adapter_in_use(command.name):
            message = (
                f"The lora adapter '{command.name}' is in use by requests; unload it once they "
                "finish."
            )
            return LoRAReply(command.command_id, 409, message)
        self.lora.unregister(command.name)
        log.info("LoRA adapter %s unloaded", command.name)
        return LoRAReply(command.command_id, 200, "")

    def refuse_unreadable_adapters(self) -> list[tuple[str, str]]:
        """Requests that wait on an adapter whose files could no longer be read (it had left host
        memory): refused with the reason, instead of waiting for ever. (request id, why)."""
        if self.lora is None or not self.lora.unreadable:
            return []
        unreadable, self.lora.unreadable = self.lora.unreadable, {}
        refused = []
        for request_id, seqs in list(self.requests.items()):
            name = seqs[0].lora_name
            if name in unreadable and all(s.status is SequenceStatus.WAITING for s in seqs):
                for seq in seqs:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
                del self.requests[request_id]
                refused.append(
                    (request_id, f"the LoRA adapter {name!r} could not be read: {unreadable[name]}")
                )
        return refused

    def _adapter_in_use(self, name: str) -> bool:
        return any(seq.lora_name == name for seqs in self.requests.values() for seq in seqs)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: AddRequest) -> None:
        """Raises ValueError for a request id in use or a prompt that cannot run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        prompt = request.prompt_token_ids
        check_prompt(
            prompt,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )
        params = request.params
        check_logit_bias(params, self.model_config.vocab_size)
        if request.lora_name is not None and (
            self.lora is None or request.lora_name not in self.lora.paths
        ):
            raise ValueError(f"the LoRA adapter {request.lora_name!r} is not loaded")
        grammars: list[SequenceGrammar | None] = [None] * params.n
        if params.structured is not None:
            grammars = list(self.structured.grammars_for(params.structured, params.n))
        seqs = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.runner.device)
                generator.manual_seed(params.seed + index)
            seqs.append(
                Sequence(
                    request_id=request.request_id,
                    index=index,
                    token_ids=list(prompt),
                    num_prompt_tokens=len(prompt),
                    params=params,
                    eos_token_ids=request.eos_token_ids,
                    cache_salt=request.cache_salt,
                    shared_prefix_tokens=request.shared_prefix_tokens,
                    priority=request.priority,
                    guard_priority=request.guard_priority,
                    lora_name=request.lora_name,
                    generator=generator,
                    grammar=grammars[index],
                )
            )
        self.requests[request.request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Finish a request's sequences (or one of them) now; unknown ids are ignored."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return
        for seq in seqs:
            if (index is None or seq.index == index) and not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        if all(s.is_finished for s in seqs):
            del self.requests[request_id]

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt block no request holds (as vLLM's reset_prefix_cache).
        Refused (False) while requests are in flight, since their blocks would stay cached."""
        if self.requests:
            return False
        self.block_manager.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.in_flight is not None

    # ---- the step ------------------------------------------------------------------------------
    def step(self, num_commands_applied: int = 0) -> StepOutputs:
        """Runs a step and returns the tokens read. With async scheduling a call launches the next
        step before it reads the one in flight, so the host's scheduling and input building
        overlap the device's work; tokens then arrive one call after their step was launched.
        Requests refused meanwhile (an adapter that can no longer be read) are in `rejected`."""
        outputs = self._step(num_commands_applied)
        refused = self.refuse_unreadable_adapters()
        if refused:
            outputs.rejected = [*outputs.rejected, *refused]
        return outputs

    def _step(self, num_commands_applied: int) -> StepOutputs:
        if not self.async_scheduling:
            launched = self._launch_next()
            if launched is None:
                return self._nothing_to_run(num_commands_applied)
            return self._complete(launched, num_commands_applied)
        previous, self.in_flight = self.in_flight, None
        drained = None
        if previous is not None and previous.needs_host_tokens:
            drained, previous = self._complete(previous, num_commands_applied), None
        self.in_flight = self._launch_next()
        if previous is not None:
            return self._complete(previous, num_commands_applied)
        if drained is not None:
            return drained
        if self.in_flight is None:
            return self._nothing_to_run(num_commands_applied)
        return self.idle_outputs(num_commands_applied)

    def _nothing_to_run(self, num_commands_applied: int) -> StepOutputs:
        compiling = self.scheduler.compiling_grammars()
        if compiling:
            # Every request left waits for its grammar: wait a moment for one rather than have
            # the caller's loop spin (and take the interpreter lock from the compile thread).
            StructuredOutputs.wait_for_any(compiling, GRAMMAR_POLL_S)
        elif self.scheduler.waits_on_adapters():
            time.sleep(GRAMMAR_POLL_S)  # their adapters are being read: no spinning meanwhile
        return self.idle_outputs(num_commands_applied)

    def _launch_next(self) -> StepInFlight | None:
        """Schedules a step and queues it on the device (None: nothing to run). Each sampling
        sequence gets a pending token in its ids, filled in by _complete."""
        started = time.monotonic()
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
            cut_to_grammar(self.scheduler.running)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        # Every prefill chunk before a request's first token: the API side keeps the first time.
        first_scheduled = [
            item.seq.request_id
            for item in plan.scheduled
            if item.seq.index == 0 and item.seq.num_output_tokens == 0
        ]
        fills = self.lora.take_fills() if self.lora is not None else None
        launched = self.runner.launch(plan.scheduled, self.structured, fills)
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for row, item in enumerate(launched.sampling):
            seq = item.seq
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending_tokens += 1
            seq.pending_row = row
            max_tokens = seq.params.max_tokens
            seq.reached_length = (
                max_tokens is not None and seq.num_output_tokens >= max_tokens
            ) or seq.num_tokens >= self.max_seq_len
        return StepInFlight(plan.scheduled, launched, first_scheduled, started)

    def _complete(self, step: StepInFlight, num_commands_applied: int) -> StepOutputs:
        """Reads a launched step's tokens (waiting for the device) and applies them."""
        result = self.runner.resolve(step.launched)
        sampling = step.launched.sampling
        live = [i for i, item in enumerate(sampling) if not item.seq.is_finished]
        positions = {}
        for i in live:  # (a finished one was aborted, or ended by its token before, meanwhile)
            seq = sampling[i].seq
            # Pending tokens trail the ids and are read in launch order: this one is the oldest.
            positions[i] = seq.num_known_tokens
            seq.token_ids[positions[i]] = result.token_ids[i]
            seq.num_pending_tokens -= 1
            if seq.num_pending_tokens == 0:
                seq.pending_row = None
        updates = self._apply_verified(step)
        # With every computed token known (the step after this one computes this one's
        # tokens), before a finished sequence's blocks go back.
        for item in step.scheduled:
            if not item.seq.is_finished:
                self.block_manager.cache_full_blocks(item.seq)
        for i in live:
            seq = sampling[i].seq
            token, position = result.token_ids[i], positions[i]
            self._check_finished(seq, token)
            if position == seq.num_prompt_tokens and seq.index == 0:
                self.num_prompt_tokens += seq.num_prompt_tokens
            updates.append(
                SeqUpdate(
                    seq.request_id,
                    seq.index,
                    token,
                    result.logprobs[i],
                    seq.finish_reason,
                    seq.stop_reason,
                    seq.num_cached_tokens,
                )
            )
            if seq.finish_reason is not None:
                self._finish(seq)
        for item in step.launched.speculated:
            if item.seq.finish_reason is not None and not item.seq.is_finished:
                self._finish(item.seq)
        self.num_generation_tokens += len(updates)
        now = time.monotonic()
        return StepOutputs(
            updates,
            self.stats(),
            num_commands_applied,
            first_scheduled=step.first_scheduled,
            scheduled_time=step.started,
            token_time=now,
            step_duration=now - step.started,
            kv_events=self.block_manager.drain_kv_events(),
        )

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        seqs = self.requests[seq.request_id]
        if all(s.is_finished for s in seqs):
            del self.requests[seq.request_id]

    def _apply_verified(self, step: StepInFlight) -> list[SeqUpdate]:
        """The speculating sequences' tokens: each run of accepted proposals and the token after
        them, appended up to the first token that ends the sequence (EOS, a stop token id,
        max_tokens, the context). Rejected proposals' KV slots lie past the tokens now, to be
        overwritten; the blocks that held only them go back."""
        launched = step.launched
        updates = []
        results = []
        for item, tokens, logprobs in zip(
            launched.speculated, launched.verified, launched.verified_logprobs, strict=True
        ):
            seq = item.seq
            num_accepted = len(tokens) - 1
            results.append((seq, item.num_spec_tokens, num_accepted))
            if seq.is_finished:  # aborted meanwhile
                continue
            max_tokens = seq.params.max_tokens
            for i, token in enumerate(tokens):
                seq.token_ids.append(token)
                seq.reached_length = (
                    max_tokens is not None and seq.num_output_tokens >= max_tokens
                ) or seq.num_tokens >= self.max_seq_len
                self._check_finished(seq, token)
                updates.append(
                    SeqUpdate(
                        seq.request_id,
                        seq.index,
                        token,
                        None if logprobs is None else logprobs[i],
                        seq.finish_reason,
                        seq.stop_reason,
                        seq.num_cached_tokens,
                        # The step's proposals count once, on its first token.
                        num_draft_tokens=0 if i else item.num_spec_tokens,
                        num_accepted_tokens=0 if i else num_accepted,
                    )
                )
                if seq.finish_reason is not None:
                    break
            # Every token but the last appended has its KV computed (the last is the next
            # step's input).
            seq.num_computed_tokens = seq.num_tokens - 1
            seq.spec_token_ids = []
            if seq.finish_reason is None:
                self.scheduler.release_unneeded_blocks(seq)
        if self.speculation is not None and results:
            self.speculation.record(results)
        return updates

    def idle_outputs(self, num_commands_applied: int) -> StepOutputs:
        """What the API side learns when no step ran: the stats, and any cache change (a reset)."""
        return StepOutputs(
            [], self.stats(), num_commands_applied, kv_events=self.block_manager.drain_kv_events()
        )

    def _check_finished(self, seq: Sequence, token: int) -> None:
        """Sets finish_reason when the token just read ends the sequence."""
        params = seq.params
        if seq.grammar is not None:
            seq.grammar.accept(token)
        is_eos = token in seq.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", (None if is_eos else token)
        elif seq.grammar is not None and seq.grammar.is_broken:
            seq.finish_reason = "abort"  # a refused token (a bug): never claim the text complete
        elif seq.grammar is not None and seq.grammar.is_terminated and token in seq.eos_token_ids:
            # ignore_eos cannot keep a finished grammar going. (A grammar that ends after a real
            # token goes on to sample the EOS its mask then allows: "stop" drops the last token's
            # text, as it does an EOS's.)
            seq.finish_reason = "stop"
        elif seq.reached_length and seq.num_pending_tokens == 0:
            seq.finish_reason = "length"

    def check_workers(self) -> None:
        """Raises WorkerDied when a tensor-parallel rank is gone (called while idle: a step finds
        out by itself)."""
        if self.workers is not None:
            self.workers.check_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the other tensor-parallel ranks and leaves their group (nothing to do alone)."""
        if self.lora is not None:
            self.lora.close()
        if self.workers is not None:
            from kvpilot.engine.parallel.group import leave_group

            workers, self.workers = self.workers, None
            workers.stop(timeout_s)
            leave_group()

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        spec = SpecDecodeCounters() if self.speculation is None else self.speculation.counters
        return EngineStats(
            num_waiting=len({s.request_id for s in self.scheduler.waiting}),
            num_running=len({s.request_id for s in self.scheduler.running}),
            kv_cache_usage=bm.usage,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            prefix_cache_queries=bm.num_queried_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            running_loras=_adapters_of(self.scheduler.running),
            waiting_loras=_adapters_of(self.scheduler.waiting),
            resident_loras=[] if self.lora is None else self.lora.resident,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos),
        )


def _adapters_of(seqs: Iterable[Sequence]) -> list[str]:
    return sorted({s.lora_name for s in seqs if s.lora_name is not None})
