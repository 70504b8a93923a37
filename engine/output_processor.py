"""From the engine core's token updates to RequestOutputs (API side): detokenization, stop strings,
logprob strings, request timings.

A stop string is found here, in text the core never sees: the sequence is finished here at once,
and `ProcessedOutputs.stop_hits` tells the caller to abort it in the core (which may have run one
more step for it meanwhile; that token is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.core.messages import SeqUpdate, StepOutputs
from kvpilot.engine.detokenizer import IncrementalDetokenizer, find_stop_string, text_decoder
from kvpilot.engine.outputs import (
    CompletionOutput,
    Logprob,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from kvpilot.engine.sampling_params import SamplingParams


@dataclass
class _SeqState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # What earlier outputs of a DELTA request held.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[_SeqState]
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    kind: OutputKind = OutputKind.CUMULATIVE

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # (request id, sequence index) finished here by a stop string: abort them in the core.
    stop_hits: list[tuple[str, int]]
    # Per request that got tokens in this step and in an earlier one: the time since that one
    # (inter-token latency), whether or not the request gets an output now (FINAL_ONLY).
    token_gaps: list[float] = field(default_factory=list)
    # Per request finished in this step: its generated tokens per sequence (a DELTA output holds
    # only the step's).
    generated: dict[str, list[int]] = field(default_factory=dict)


class OutputProcessor:
    """Not thread-safe: the caller serializes add / abort / process."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = None if tokenizer is None else text_decoder(tokenizer)
        self.requests: dict[str, _RequestState] = {}
        self._token_texts: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        """kind: CUMULATIVE snapshots copy a sequence's token lists every step (O(length) per
        token); DELTA outputs hold only the step's additions (what a stream sends); FINAL_ONLY
        returns one output, when the request finishes (at 256 requests a step of snapshots is
        ~2 ms of host time the GPU waits for)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = [
            _SeqState(
                index,
                None
                if self._decode is None
                else IncrementalDetokenizer(self._decode, prompt_token_ids),
            )
            for index in range(params.n)
        ]
        self.requests[request_id] = _RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            RequestMetrics(arrival_time),
            seqs,
            kind=kind,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a request; its last output with finish_reason "abort" on unfinished sequences."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process(self, step: StepOutputs) -> ProcessedOutputs:
        for request_id in step.first_scheduled:
            request = self.requests.get(request_id)
            if request is not None and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = step.scheduled_time
        touched: dict[str, _RequestState] = {}
        stop_hits: list[tuple[str, int]] = []
        token_gaps: list[float] = []
        for update in step.updates:
            request = self.requests.get(update.request_id)
            if request is None:  # aborted here while the core was stepping
                continue
            seq = request.seqs[update.index]
            # Counted even past a stop string: the engine's counters count them too.
            request.num_draft_tokens += update.num_draft_tokens
            request.num_accepted_tokens += update.num_accepted_tokens
            if seq.finish_reason is not None:  # a stop string ended it before this step landed
                continue
            if self._apply(request, seq, update) and update.finish_reason is None:
                stop_hits.append((request.request_id, seq.index))
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = step.token_time
            elif request.request_id not in touched and metrics.last_token_time is not None:
                token_gaps.append(step.token_time - metrics.last_token_time)
            metrics.last_token_time = step.token_time
            if update.index == 0:
                request.num_cached_tokens = update.num_cached_tokens
            touched[request.request_id] = request
        outputs = []
        generated: dict[str, list[int]] = {}
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = step.token_time
                del self.requests[request.request_id]
                generated[request.request_id] = [len(s.output_token_ids) for s in request.seqs]
            elif request.kind is OutputKind.FINAL_ONLY:
                continue
            outputs.append(self._output(request))
        return ProcessedOutputs(outputs, stop_hits, token_gaps, generated)

    def _apply(self, request: _RequestState, seq: _SeqState, update: SeqUpdate) -> bool:
        """Add the update's token to the sequence; True when a stop string ended it here."""
        token = update.token_id
        seq.output_token_ids.append(token)
        if update.logprobs is not None:
            chosen, rank, top = update.logprobs
            entry = {token: Logprob(chosen, rank, self._token_text(token))}
            for r, (tok, lp) in enumerate(top, start=1):
                entry.setdefault(tok, Logprob(lp, r, self._token_text(tok)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += chosen
        seq.finish_reason, seq.stop_reason = update.finish_reason, update.stop_reason
        # An EOS or stop token is not part of the text.
        if seq.detokenizer is None or update.finish_reason == "stop":
            return False
        new_text = seq.detokenizer.append(token)
        seq.output_text += new_text
        stops = request.params.stop
        if not new_text or not stops:
            return False
        hit = find_stop_string(seq.output_text, len(new_text), stops)
        if hit is None:
            return False
        index, stop = hit
        keep = index + len(stop) if request.params.include_stop_str_in_output else index
        seq.output_text = seq.output_text[:keep]
        # A stop string beats "length" on the same token.
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def _token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _output(self, request: _RequestState) -> RequestOutput:
        """A snapshot, or a DELTA request's additions: its lists are copies, so a reader on
        another thread never sees them grow."""
        completions = []
        wants_logprobs = request.params.logprobs is not None
        delta = request.kind is OutputKind.DELTA
        for seq in request.seqs:
            text_end = len(seq.output_text)
            if seq.finish_reason is None and request.params.stop:
                # Hold back what could still become a stop string: sent text never shrinks.
                text_end = max(0, text_end - request.params.stop_holdback_chars)
            text_start = tokens_start = 0
            if delta:
                text_start, tokens_start = seq.num_sent_chars, seq.num_sent_tokens
                seq.num_sent_chars = max(text_start, text_end)
                seq.num_sent_tokens = len(seq.output_token_ids)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.output_text[text_start:text_end],
                    token_ids=seq.output_token_ids[tokens_start:],
                    cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                    logprobs=seq.logprobs[tokens_start:] if wants_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        m = request.metrics
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=request.num_cached_tokens,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            metrics=RequestMetrics(
                m.arrival_time,
                m.first_scheduled_time,
                m.first_token_time,
                m.last_token_time,
                m.finished_time,
            ),
        )
