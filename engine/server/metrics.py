"""Prometheus metrics of one served model, under `kvpilot:` and (by default) vLLM's `vllm:` names.

Every metric is registered on the CollectorRegistry passed in (never the global one), so tests and
several servers in one process do not collide. Each logical metric fans out to one child per prefix,
so the two name sets can never disagree (a histogram is one set of counts shown under both names,
written out by histograms.py). The output thread records through `record_counters` and
`record_finished`; gauges of engine state are read at scrape time from callables (no lag between a
scheduler change and what KEDA or the Gateway API Inference Extension sees, beyond one engine step).
See engine/server/README.md for the meaning of every metric.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvpilot.contract.load_metrics import (
    GPU_CACHE_USAGE,
    KV_CACHE_USAGE,
    KVPILOT,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    VLLM,
)
from kvpilot.contract.lora import LORA_INFO_LABELS
from kvpilot.contract.prometheus import Family
from kvpilot.engine.outputs import RequestMetrics, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.histograms import Histogram, HistogramSet

# One line per finished request with where its time went (--log-level debug): the histograms
# mix every request, a tail is found by reading the requests that made it.
_timing_log = logging.getLogger("kvpilot.request_timing")

# vLLM labels its metrics with the index of the engine core (data parallelism); kvpilot runs one.
VLLM_ENGINE_INDEX = "0"

# vLLM's buckets, so dashboards built for vLLM's histograms render the same quantiles.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM's buckets of vllm:iteration_tokens_total (tokens per engine step), vllm:request_params_n
# and vllm:time_per_prefill_token_request_seconds.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREFILL_TOKEN_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FINISHED_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("invalid_request", "model_not_found", "queue_full", "draining", "loading")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50 ... up to max_value: vLLM's buckets of token counts per request."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class EngineCounters:
    """The cumulative engine counters the metrics follow (a subset of EngineStats)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @classmethod
    def of(cls, stats: Any) -> EngineCounters:
        return cls(
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            num_prompt_tokens=stats.num_prompt_tokens,
            num_generation_tokens=stats.num_generation_tokens,
            spec_num_drafts=stats.spec_num_drafts,
            spec_num_draft_tokens=stats.spec_num_draft_tokens,
            spec_num_accepted_tokens=stats.spec_num_accepted_tokens,
            spec_accepted_per_pos=tuple(stats.spec_accepted_per_pos),
        )


# The families of a served model. Each shared one is shown as `kvpilot:<name>` and, unless vLLM's
# names are switched off, `vllm:<name>`, with the prefix's fixed labels (model_name; under vllm:
# also vLLM's `engine`) before its own. A histogram is one set of counts under every name.
# Help texts, label names and buckets are what KEDA recipes, the Gateway API Inference Extension
# and vLLM's dashboards read: tests/server/test_metrics.py holds them to a literal table.
_Histogram = prometheus_client.Histogram  # the family's type (the counts are histograms.py's)

# Engine state, read at scrape time: NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING and
# KV_CACHE_USAGE, the rows the autoscaler reads (kvpilot.contract.load_metrics).
# Engine counters, advanced by deltas of the engine's cumulative stats.
PREFIX_CACHE_QUERIES = Family(
    Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
)
PREFIX_CACHE_HITS = Family(
    Counter, "prefix_cache_hits", "Prompt tokens served from the prefix cache."
)
NUM_PREEMPTIONS = Family(Counter, "num_preemptions", "Requests preempted by the engine.")
PROMPT_TOKENS = Family(Counter, "prompt_tokens", "Prompt tokens computed (prefilled).")
GENERATION_TOKENS = Family(Counter, "generation_tokens", "Tokens generated.")
REQUEST_SUCCESS = Family(
    Counter, "request_success", "Finished requests by finish reason.", ("finished_reason",)
)
# Per-request latencies, observed when a request finishes (ITL per token-producing step).
TIME_TO_FIRST_TOKEN = Family(
    _Histogram,
    "time_to_first_token_seconds",
    "Arrival to first generated token.",
    buckets=TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Family(
    _Histogram,
    "inter_token_latency_seconds",
    "Time between successive token-producing engine steps of a request.",
    buckets=TOKEN_LATENCY_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Family(
    _Histogram,
    "time_per_output_token_seconds",
    "Per request: (last token time - first token time) / (generated tokens - 1).",
    buckets=TOKEN_LATENCY_BUCKETS,
)
E2E_REQUEST_LATENCY = Family(
    _Histogram,
    "e2e_request_latency_seconds",
    "Arrival to finish of a request.",
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_QUEUE_TIME = Family(
    _Histogram,
    "request_queue_time_seconds",
    "Arrival to first scheduling (time spent waiting).",
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_INFERENCE_TIME = Family(
    _Histogram,
    "request_inference_time_seconds",
    "First scheduling to last token (time spent running).",
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_PREFILL_TIME = Family(
    _Histogram,
    "request_prefill_time_seconds",
    "First scheduling to first token (time spent in prefill).",
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_DECODE_TIME = Family(
    _Histogram,
    "request_decode_time_seconds",
    "First token to last token (time spent in decode).",
    buckets=REQUEST_LATENCY_BUCKETS,
)
TIME_PER_PREFILL_TOKEN = Family(
    _Histogram,
    "time_per_prefill_token_request_seconds",
    "Per request: prefill time / prompt tokens.",
    buckets=PREFILL_TOKEN_LATENCY_BUCKETS,
)
# Per-request sizes, observed when a request finishes. No buckets here: vLLM's 1-2-5 series up to
# the model's context (build_1_2_5_buckets(max_model_len)).
REQUEST_PROMPT_TOKENS = Family(
    _Histogram, "request_prompt_tokens", "Prompt tokens of a finished request."
)
REQUEST_GENERATION_TOKENS = Family(
    _Histogram,
    "request_generation_tokens",
    "Tokens a finished request generated (all its choices).",
)
REQUEST_MAX_NUM_GENERATION_TOKENS = Family(
    _Histogram,
    "request_max_num_generation_tokens",
    "Tokens generated by a finished request's longest choice.",
)
REQUEST_PARAMS_MAX_TOKENS = Family(
    _Histogram, "request_params_max_tokens", "The max_tokens parameter of a request."
)
REQUEST_PARAMS_N = Family(
    _Histogram, "request_params_n", "The n parameter of a request.", buckets=N_BUCKETS
)
# Tokens per engine step.
ITERATION_TOKENS = Family(
    _Histogram,
    "iteration_tokens_total",
    "Tokens per engine step: prompts that got their first token, plus tokens generated.",
    buckets=ITERATION_TOKEN_BUCKETS,
)
# Speculative decoding (vLLM's), declared only when the engine speculates.
SPEC_DECODE_NUM_DRAFTS = Family(
    Counter, "spec_decode_num_drafts", "Number of spec decoding drafts."
)
SPEC_DECODE_NUM_DRAFT_TOKENS = Family(
    Counter, "spec_decode_num_draft_tokens", "Number of draft tokens."
)
SPEC_DECODE_NUM_ACCEPTED_TOKENS = Family(
    Counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens."
)
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = Family(
    Counter,
    "spec_decode_num_accepted_tokens_per_pos",
    "Accepted tokens per draft position.",
    ("position",),
)
CACHE_CONFIG_INFO = Family(
    Gauge,
    "cache_config_info",
    "KV-cache configuration; the value is always 1.",
    ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"),
)

# vLLM's pre-0.9 names, shown under vllm: only, each beside the family it aliases: still read by
# many KEDA and HPA recipes (gpu_cache_usage_perc) and older dashboards (the prefix cache's).
VLLM_ALIASES = {
    KV_CACHE_USAGE: GPU_CACHE_USAGE,
    PREFIX_CACHE_QUERIES: Family(
        Counter, "gpu_prefix_cache_queries", f"Deprecated alias of {VLLM}:prefix_cache_queries."
    ),
    PREFIX_CACHE_HITS: Family(
        Counter, "gpu_prefix_cache_hits", f"Deprecated alias of {VLLM}:prefix_cache_hits."
    ),
}

# kvpilot's own server-level metrics (no vLLM equivalent): shown under kvpilot: only.
PARALLEL_CONFIG_INFO = Family(
    Gauge,
    "parallel_config_info",
    "How the model is split; the value is always 1. KV-cache blocks and usage count the "
    "whole model (one block is one block on every rank).",
    ("tensor_parallel_size",),
)
ENGINE_STEP_DURATION = Family(
    _Histogram,
    "engine_step_duration_seconds",
    "Wall time of one engine-core step (scheduling, forward, sampling).",
    buckets=STEP_BUCKETS,
)
NUM_REQUESTS_IN_FLIGHT = Family(
    Gauge,
    "num_requests_in_flight",
    "HTTP generation requests admitted and not yet answered (what a drain waits for).",
)
REQUESTS_REJECTED = Family(
    Counter,
    "requests_rejected",
    "Requests refused before reaching the engine, by reason.",
    ("reason",),
)
DRAINING = Family(Gauge, "draining", "1 while the server drains after SIGTERM, else 0.")
# LoRA adapters, declared only when the engine serves them. lora_requests_info is vLLM's (the
# Gateway API Inference Extension reads its labels): one sample, whose value is the wall-clock time
# of the last change, its labels the adapters of the running and the waiting requests
# (comma-separated) and the slots.
LORA_REQUESTS_INFO = Family(
    Gauge,
    "lora_requests_info",
    "Running stats on LoRA requests; the value is the time of the last change.",
    LORA_INFO_LABELS,
)
LORA_REQUESTS = Family(
    Counter, "lora_requests", "Finished requests per LoRA adapter.", ("lora_name",)
)
LORA_PROMPT_TOKENS = Family(
    Counter, "lora_prompt_tokens", "Prompt tokens of finished requests per LoRA adapter.",
    ("lora_name",),
)  # fmt: skip
LORA_GENERATION_TOKENS = Family(
    Counter, "lora_generation_tokens", "Tokens generated by finished requests per LoRA adapter.",
    ("lora_name",),
)  # fmt: skip


class _Fanout:
    """One logical metric with a labelled child per prefix (`kvpilot:x`, `vllm:x`)."""

    def __init__(self, children: Sequence[Any]) -> None:
        self.children = list(children)

    def inc(self, amount: float = 1.0) -> None:
        if amount:
            for child in self.children:
                child.inc(amount)

    def set(self, value: float) -> None:
        for child in self.children:
            child.set(value)

    def set_function(self, fn: Callable[[], float]) -> None:
        for child in self.children:
            child.set_function(fn)


class ServerMetrics:
    """The families above for one served model, on the caller's registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        *,
        block_size: int,
        num_gpu_blocks: int,
        enable_prefix_caching: bool,
        cache_dtype: str = "auto",
        max_model_len: int,
        vllm_names: bool = True,
        tensor_parallel_size: int = 1,
        max_loras: int = 0,
        num_speculative_tokens: int = 0,
    ) -> None:
        """max_loras: the engine's adapter slots (0: adapters off, and no adapter metric);
        num_speculative_tokens: proposals per step at most (0: no speculation metric)."""
        self.registry = registry
        self.model_name = model_name
        self._prefixes = (KVPILOT, VLLM) if vllm_names else (KVPILOT,)
        self._last = EngineCounters()
        # Counters and gauges (prometheus_client's, registered one by one, in this order); the
        # histograms are one collector, registered last, once all of them are in it.
        self._simple: list[Any] = []
        self._histograms = HistogramSet()

        self.num_requests_waiting, self.num_requests_running, self.kv_cache_usage = self._fanouts(
            NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, KV_CACHE_USAGE
        )
        self.prefix_cache_queries, self.prefix_cache_hits = self._fanouts(
            PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS
        )
        self.num_preemptions, self.prompt_tokens, self.generation_tokens = self._fanouts(
            NUM_PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS
        )
        success = self._declare_shared(REQUEST_SUCCESS)
        self.request_success = {
            reason: _Fanout([bind(reason) for bind in success]) for reason in FINISHED_REASONS
        }

        self.time_to_first_token = self._histogram(TIME_TO_FIRST_TOKEN)
        self.inter_token_latency = self._histogram(INTER_TOKEN_LATENCY)
        self.time_per_output_token = self._histogram(TIME_PER_OUTPUT_TOKEN)
        self.e2e_request_latency = self._histogram(E2E_REQUEST_LATENCY)
        self.request_queue_time = self._histogram(REQUEST_QUEUE_TIME)
        self.request_inference_time = self._histogram(REQUEST_INFERENCE_TIME)
        self.request_prefill_time = self._histogram(REQUEST_PREFILL_TIME)
        self.request_decode_time = self._histogram(REQUEST_DECODE_TIME)
        self.time_per_prefill_token = self._histogram(TIME_PER_PREFILL_TOKEN)
        tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram(REQUEST_PROMPT_TOKENS, tokens)
        self.request_generation_tokens = self._histogram(REQUEST_GENERATION_TOKENS, tokens)
        self.request_max_num_generation_tokens = self._histogram(
            REQUEST_MAX_NUM_GENERATION_TOKENS, tokens
        )
        self.request_params_max_tokens = self._histogram(REQUEST_PARAMS_MAX_TOKENS, tokens)
        self.request_params_n = self._histogram(REQUEST_PARAMS_N)
        self.iteration_tokens = self._histogram(ITERATION_TOKENS)

        for bind in self._declare_shared(CACHE_CONFIG_INFO):
            bind(str(block_size), str(num_gpu_blocks), str(enable_prefix_caching), cache_dtype).set(
                1
            )

        self._declare(PARALLEL_CONFIG_INFO, KVPILOT)(str(tensor_parallel_size)).set(1)
        self.engine_step_duration = self._histogram(ENGINE_STEP_DURATION, prefixes=(KVPILOT,))
        self.num_requests_in_flight = self._declare(NUM_REQUESTS_IN_FLIGHT, KVPILOT)()
        rejected = self._declare(REQUESTS_REJECTED, KVPILOT)
        self.requests_rejected = {reason: rejected(reason) for reason in REJECT_REASONS}
        self.draining = self._declare(DRAINING, KVPILOT)()
        self.max_loras = max_loras
        self._lora_info: list[tuple[Any, list[str]]] = []
        self._lora_labels: tuple[str, str] | None = None
        if max_loras:
            for prefix in self._prefixes:
                self._declare(LORA_REQUESTS_INFO, prefix)
                # The gauge itself (the last declared): each change replaces its one sample.
                self._lora_info.append((self._simple[-1], self._fixed_labels(prefix)[1]))
            self.lora_requests = self._declare(LORA_REQUESTS, KVPILOT)
            self.lora_prompt_tokens = self._declare(LORA_PROMPT_TOKENS, KVPILOT)
            self.lora_generation_tokens = self._declare(LORA_GENERATION_TOKENS, KVPILOT)
            self.record_loras([], [], now=0.0)
        self.spec_decode: list[_Fanout] = []
        self.spec_accepted_per_pos: list[_Fanout] = []
        if num_speculative_tokens:
            self.spec_decode = self._fanouts(
                SPEC_DECODE_NUM_DRAFTS,
                SPEC_DECODE_NUM_DRAFT_TOKENS,
                SPEC_DECODE_NUM_ACCEPTED_TOKENS,
            )
            per_pos = self._declare_shared(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS)
            self.spec_accepted_per_pos = [
                _Fanout([bind(str(pos)) for bind in per_pos])
                for pos in range(num_speculative_tokens)
            ]
        registry.register(self._histograms)

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text format: what generate_latest(registry) writes,
        with the histograms written in one pass (a few times faster; see histograms.py)."""
        return generate_latest(_Metrics(self._simple)) + self._histograms.render().encode()

    def _declare(self, family: Family[Any], prefix: str) -> Callable[..., Any]:
        """Register `family` as `prefix:name`; returns (its own label values) -> its child, with
        the prefix's fixed labels filled in."""
        fixed_names, fixed = self._fixed_labels(prefix)
        shown = replace(
            family, name=f"{prefix}:{family.name}", labels=(*fixed_names, *family.labels)
        )
        metric = shown.declare(self.registry)
        self._simple.append(metric)
        return lambda *values: metric.labels(*fixed, *values)

    def _declare_shared(self, family: Family[Any]) -> list[Callable[..., Any]]:
        """`family` under every prefix."""
        return [self._declare(family, prefix) for prefix in self._prefixes]

    def _fanouts(self, *families: Family[Any]) -> list[_Fanout]:
        """Unlabelled counters or gauges under every prefix, then vLLM's aliases of them."""
        fanouts = [_Fanout([bind() for bind in self._declare_shared(f)]) for f in families]
        if VLLM in self._prefixes:
            for family, fanout in zip(families, fanouts, strict=True):
                if family in VLLM_ALIASES:
                    fanout.children.append(self._declare(VLLM_ALIASES[family], VLLM)())
        return fanouts

    def _histogram(
        self,
        family: Family[Any],
        buckets: Sequence[float] | None = None,
        prefixes: Sequence[str] | None = None,
    ) -> Histogram:
        """One set of counts, shown under every prefix (or these); `buckets` for a family that
        leaves them to the model."""
        bounds = family.buckets if buckets is None else buckets
        if bounds is None:
            raise ValueError(f"{family.name} needs buckets")
        histogram = Histogram(bounds)
        for prefix in self._prefixes if prefixes is None else prefixes:
            fixed_names, fixed = self._fixed_labels(prefix)
            labels = [*fixed_names, *family.labels]
            self._histograms.add(histogram, f"{prefix}:{family.name}", family.doc, labels, fixed)
        return histogram

    def _fixed_labels(self, prefix: str) -> tuple[list[str], list[str]]:
        """The labels every metric under `prefix` carries: model_name and, under vllm:, vLLM's
        `engine` (one engine core, index 0)."""
        if prefix == VLLM:
            return ["model_name", "engine"], [self.model_name, VLLM_ENGINE_INDEX]
        return ["model_name"], [self.model_name]

    def bind_engine_state(
        self,
        num_waiting: Callable[[], float],
        num_running: Callable[[], float],
        kv_cache_usage: Callable[[], float],
    ) -> None:
        self.num_requests_waiting.set_function(num_waiting)
        self.num_requests_running.set_function(num_running)
        self.kv_cache_usage.set_function(kv_cache_usage)

    def record_counters(self, counters: EngineCounters) -> None:
        """Advance the counters to the engine's cumulative values (output thread only)."""
        last, self._last = self._last, counters
        self.prefix_cache_queries.inc(
            max(0, counters.prefix_cache_queries - last.prefix_cache_queries)
        )
        self.prefix_cache_hits.inc(max(0, counters.prefix_cache_hits - last.prefix_cache_hits))
        self.num_preemptions.inc(max(0, counters.num_preemptions - last.num_preemptions))
        self.prompt_tokens.inc(max(0, counters.num_prompt_tokens - last.num_prompt_tokens))
        num_generated = max(0, counters.num_generation_tokens - last.num_generation_tokens)
        self.generation_tokens.inc(num_generated)
        if self.spec_decode:
            drafts, draft_tokens, accepted = self.spec_decode
            drafts.inc(max(0, counters.spec_num_drafts - last.spec_num_drafts))
            draft_tokens.inc(max(0, counters.spec_num_draft_tokens - last.spec_num_draft_tokens))
            accepted.inc(max(0, counters.spec_num_accepted_tokens - last.spec_num_accepted_tokens))
            before = last.spec_accepted_per_pos
            for pos, (fanout, now) in enumerate(
                zip(self.spec_accepted_per_pos, counters.spec_accepted_per_pos, strict=False)
            ):
                fanout.inc(max(0, now - (before[pos] if pos < len(before) else 0)))
        # vLLM counts an iteration's prompt tokens when their first token comes, as the engine
        # core does: the step's tokens are the two deltas. Steps that produced nothing are idle.
        if num_generated:
            num_prompt = max(0, counters.num_prompt_tokens - last.num_prompt_tokens)
            self.iteration_tokens.observe(num_prompt + num_generated)

    def record_loras(self, running: Sequence[str], waiting: Sequence[str], now: float) -> None:
        """The adapters of the running and the waiting requests (output thread only): a new
        sample, stamped `now`, when they change; the old one goes (one series at a time)."""
        labels = (",".join(running), ",".join(waiting))
        if labels == self._lora_labels:
            return
        self._lora_labels = labels
        for gauge, fixed in self._lora_info:
            gauge.clear()
            gauge.labels(*fixed, str(self.max_loras), *labels).set(now)

    def record_adapter_request(self, lora_name: str, prompt_tokens: int, generated: int) -> None:
        self.lora_requests(lora_name).inc()
        self.lora_prompt_tokens(lora_name).inc(prompt_tokens)
        self.lora_generation_tokens(lora_name).inc(generated)

    def record_finished(
        self,
        output: RequestOutput,
        finished_reason: str,
        params: SamplingParams | None = None,
        generated: list[int] | None = None,
    ) -> None:
        """Observe the sizes and latencies of a finished request (output thread only).
        generated: tokens per choice, where `output` holds only its last step's (DELTA); by
        default counted from `output`."""
        self.request_success[
            finished_reason if finished_reason in FINISHED_REASONS else "stop"
        ].inc()
        if generated is None:
            generated = [len(o.token_ids) for o in output.outputs]
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(generated))
        self.request_max_num_generation_tokens.observe(max(generated, default=0))
        if params is not None:
            self.request_params_n.observe(params.n)
            if params.max_tokens is not None:
                self.request_params_max_tokens.observe(params.max_tokens)
        m = output.metrics
        if m is None:
            return
        if _timing_log.isEnabledFor(logging.DEBUG):
            _timing_log.debug(
                "%s: prompt %d tokens (%d cached), %s",
                output.request_id,
                len(output.prompt_token_ids),
                output.num_cached_tokens,
                request_phases(m),
            )
        if m.first_token_time is not None:
            self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e_request_latency.observe(max(0.0, m.finished_time - m.arrival_time))
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            prefill = max(0.0, m.first_token_time - m.first_scheduled_time)
            self.request_prefill_time.observe(prefill)
            if output.prompt_token_ids:
                self.time_per_prefill_token.observe(prefill / len(output.prompt_token_ids))
            if m.last_token_time is not None:
                self.request_inference_time.observe(
                    max(0.0, m.last_token_time - m.first_scheduled_time)
                )
        if m.first_token_time is not None and m.last_token_time is not None:
            self.request_decode_time.observe(max(0.0, m.last_token_time - m.first_token_time))
        num_generated = max(generated, default=0)
        if num_generated > 1 and m.first_token_time is not None and m.last_token_time is not None:
            decode = max(0.0, m.last_token_time - m.first_token_time)
            self.time_per_output_token.observe(decode / (num_generated - 1))


def request_phases(m: RequestMetrics) -> str:
    """Where a request's time went, in ms from its arrival: queued (to its first step), first
    token, finished; `-` for what it never reached."""

    def since_arrival(t: float | None) -> str:
        return "-" if t is None else f"{1000 * max(0.0, t - m.arrival_time):.1f}"

    return (
        f"queued {since_arrival(m.first_scheduled_time)} ms, first token "
        f"{since_arrival(m.first_token_time)} ms, finished {since_arrival(m.finished_time)} ms"
    )


class _Metrics:
    """prometheus_client metrics as one collectable (what generate_latest takes)."""

    def __init__(self, metrics: list[Any]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        for metric in self.metrics:
            yield from metric.collect()


def finished_reason(output: RequestOutput) -> str:
    """One label for a request of n choices: abort beats length beats stop."""
    reasons = {o.finish_reason for o in output.outputs}
    for reason in ("abort", "length"):
        if reason in reasons:
            return reason
    return "stop"
