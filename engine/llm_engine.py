"""The step-level engine: add_request / step / abort_request. Glue between scheduler, runner and
outputs.

Not thread-safe: one thread or task owns an engine; the server passes requests to it through a
queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvpilot.engine.block_manager import BlockManager
from kvpilot.engine.config import EngineConfig, ModelConfig
from kvpilot.engine.detokenizer import decode_new_text, find_stop_string, init_offsets
from kvpilot.engine.model.loader import (
    has_tokenizer,
    load_tokenizer,
    read_hf_config,
    resolve_model,
    set_offline_defaults,
)
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.sequence import Sequence

log = logging.getLogger("kvpilot")


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        set_offline_defaults()
        self.config = config = config or EngineConfig()
        started = time.monotonic()
        log.info("loading model %s", config.model or "(bundled SmolLM2-135M-Instruct)")
        source = resolve_model(config.model, config.load_format)
        hf_config = read_hf_config(source.hf_dir)
        self.model_config = ModelConfig.from_hf_config(hf_config)
        self.model_name = config.served_model_name or source.name
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.tokenizer = load_tokenizer(source.hf_dir) if has_tokenizer(source.hf_dir) else None
        if self.tokenizer is None:
            log.warning("no tokenizer files in %s: prompts must be token ids", source.hf_dir)
        self.eos_token_ids = self._eos_token_ids()
        self.runner = ModelRunner(config, self.model_config, source, self.max_model_len)
        self.block_size = config.cache.block_size
        self.num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(
            self.num_blocks, self.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        # A sequence can never outgrow the whole pool: it stops with "length" there instead of
        # hanging.
        self.max_seq_len = min(self.max_model_len, self.num_blocks * self.block_size)
        self.requests: dict[str, _Request] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        log.info("engine ready in %.1f s: %s", time.monotonic() - started, self.model_name)

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            prompt_text: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_text, prompt_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        self._check_prompt_fits(len(prompt_ids))
        seqs = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.runner.device)
                generator.manual_seed(params.seed + index)
            seq = Sequence(
                request_id=request_id,
                index=index,
                token_ids=list(prompt_ids),
                num_prompt_tokens=len(prompt_ids),
                params=params,
                cache_salt=cache_salt,
                generator=generator,
            )
            init_offsets(seq)
            seqs.append(seq)
        metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time
        )
        self.requests[request_id] = _Request(
            request_id, prompt_text, list(prompt_ids), seqs, metrics
        )
        for seq in seqs:
            self.scheduler.add(seq)

    def _check_prompt_fits(self, num_tokens: int) -> None:
        if num_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_tokens} tokens, but this model's context is "
                f"{self.max_model_len} "
                "tokens, including at least one generated token"
            )
        if num_tokens >= self.num_blocks * self.block_size:
            raise ValueError(
                f"the prompt has {num_tokens} tokens, but the whole KV cache holds "
                f"{self.num_blocks * self.block_size} tokens ({self.num_blocks} blocks of "
                f"{self.block_size})"
            )

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt block no request holds (as vLLM's reset_prefix_cache), e.g.
        between benchmark rounds of the same prompts. Refused (False) while requests are in
        flight, since their blocks would stay cached."""
        if self.has_unfinished_requests():
            return False
        self.block_manager.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        now = time.monotonic()
        for item in plan.scheduled:
            metrics = self.requests[item.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        sampled, result = self.runner.execute(plan.scheduled)
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for i, item in enumerate(sampled):
            seq = item.seq
            self._append_token(seq, result.token_ids[i], result.logprobs[i])
            self.num_generation_tokens += 1
            if seq.num_output_tokens == 1 and seq.index == 0:
                self.num_prompt_tokens += seq.num_prompt_tokens
            request = self.requests[seq.request_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched[seq.request_id] = request
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                del self.requests[request.request_id]
            outputs.append(self._output(request))
        return outputs

    def _append_token(
        self, seq: Sequence, token: int, logprobs: tuple[float, int, list[tuple[int, float]]] | None
    ) -> None:
        seq.token_ids.append(token)
        if logprobs is not None:
            chosen, rank, top = logprobs
            entry = {token: Logprob(chosen, rank, self._token_text(token))}
            for r, (tok, lp) in enumerate(top, start=1):
                entry.setdefault(tok, Logprob(lp, r, self._token_text(tok)))
            seq.output_logprobs.append(entry)
            seq.cumulative_logprob += chosen
        params = seq.params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", (None if is_eos else token)
            # The stop token itself is not part of the text.
            self._extend_text(seq, seq.num_tokens - 1)
            return
        self._extend_text(seq)
        if seq.finish_reason is None and (
            (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_seq_len
        ):
            seq.finish_reason = "length"

    def _extend_text(self, seq: Sequence, num_ids: int | None = None) -> None:
        if self.tokenizer is None:
            return
        new_text = decode_new_text(self.tokenizer, seq, num_ids)
        seq.output_text += new_text
        if not new_text or not seq.params.stop:
            return
        hit = find_stop_string(seq.output_text, len(new_text), seq.params.stop)
        if hit is not None:
            index, stop = hit
            keep = index + len(stop) if seq.params.include_stop_str_in_output else index
            seq.output_text = seq.output_text[:keep]
            seq.finish_reason, seq.stop_reason = "stop", stop

    def _token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token])

    def _output(self, request: _Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            text = seq.output_text
            if seq.finish_reason is None and seq.params.stop:
                # Hold back what could still become a stop string.
                holdback = seq.params.stop_holdback_chars
                text = text[: max(0, len(text) - holdback)]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob
                    if seq.params.logprobs is not None
                    else None,
                    logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=request.metrics,
        )

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
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
        )
