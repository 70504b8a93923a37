"""ServerMetrics on a private registry: vLLM's exact names, both prefixes, deltas, latencies."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as ClientHistogram
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.histograms import Histogram, HistogramSet
from kvpilot.engine.server.metrics import (
    TOKEN_LATENCY_BUCKETS,
    EngineCounters,
    ServerMetrics,
    finished_reason,
)

# What KEDA recipes, the Gateway API Inference Extension and vLLM's Grafana dashboard read.
VLLM_NAMES = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:time_per_prefill_token_request_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
}
# vLLM's deprecated aliases: vLLM only.
VLLM_ALIASES = {
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:gpu_prefix_cache_queries": "counter",
    "vllm:gpu_prefix_cache_hits": "counter",
}
# vLLM's buckets (vllm/v1/metrics/loggers.py), as `le` labels in the exposition.
VLLM_BUCKETS = {
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:time_per_prefill_token_request_seconds": [
        0.001,
        0.002,
        0.005,
        0.01,
        0.02,
        0.05,
        0.1,
        0.2,
        0.5,
        1.0,
    ],
    "vllm:request_prefill_time_seconds": [
        0.3,
        0.5,
        0.8,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        10.0,
        15.0,
        20.0,
        30.0,
        40.0,
        50.0,
        60.0,
        120.0,
        240.0,
        480.0,
        960.0,
        1920.0,
        7680.0,
    ],
    # build_1_2_5_buckets(max_model_len=2048)
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
    "vllm:request_max_num_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
}


def build(
    vllm_names: bool = True, model_name: str = "m"
) -> tuple[ServerMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = ServerMetrics(
        registry,
        model_name,
        block_size=16,
        num_gpu_blocks=100,
        enable_prefix_caching=True,
        max_model_len=2048,
        vllm_names=vllm_names,
    )
    metrics.bind_engine_state(lambda: 3, lambda: 2, lambda: 0.25)
    return metrics, registry


def families(registry: CollectorRegistry) -> dict[str, Metric]:
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    engine = {"engine": "0"} if name.startswith("vllm:") else {}  # vLLM's engine-core index
    value = registry.get_sample_value(name, {"model_name": "m", **engine, **labels})
    assert value is not None, f"{name} {labels} is not exported"
    return value


def test_vllm_names_and_types_are_exact_and_mirrored_under_kvpilot() -> None:
    _, registry = build()
    found = families(registry)
    for name, kind in VLLM_NAMES.items():
        assert found[name].type == kind, name
        own = "kvpilot:" + name.split(":", 1)[1]
        assert found[own].type == kind, own
    for name, kind in VLLM_ALIASES.items():
        assert found[name].type == kind, name
    # Every sample carries model_name; vLLM's names also vLLM's engine label.
    for family in found.values():
        for s in family.samples:
            assert s.labels.get("model_name") == "m", s
            assert s.labels.get("engine") == ("0" if s.name.startswith("vllm:") else None), s


def test_histogram_buckets_are_vllms() -> None:
    _, registry = build()
    found = families(registry)
    for name, buckets in VLLM_BUCKETS.items():
        bounds = [float(s.labels["le"]) for s in found[name].samples if s.name.endswith("_bucket")]
        assert bounds == [*map(float, buckets), float("inf")], name


def test_vllm_names_can_be_switched_off() -> None:
    _, registry = build(vllm_names=False)
    names = families(registry)
    assert not [n for n in names if n.startswith("vllm:")]
    assert "kvpilot:num_requests_waiting" in names


def test_state_gauges_are_read_at_scrape_time_and_cache_info_is_labelled() -> None:
    _, registry = build()
    assert sample(registry, "vllm:num_requests_waiting") == 3
    assert sample(registry, "kvpilot:num_requests_running") == 2
    assert sample(registry, "vllm:kv_cache_usage_perc") == 0.25
    assert sample(registry, "vllm:gpu_cache_usage_perc") == 0.25
    info = {"block_size": "16", "num_gpu_blocks": "100", "enable_prefix_caching": "True"}
    assert sample(registry, "vllm:cache_config_info", **info) == 1


def test_counters_follow_cumulative_engine_stats_by_delta() -> None:
    metrics, registry = build()
    metrics.record_counters(EngineCounters(40, 16, 0, 40, 5))
    metrics.record_counters(EngineCounters(80, 48, 1, 80, 12))
    assert sample(registry, "vllm:prefix_cache_queries_total") == 80
    assert sample(registry, "vllm:prefix_cache_hits_total") == 48
    assert sample(registry, "kvpilot:prefix_cache_hits_total") == 48
    assert sample(registry, "vllm:num_preemptions_total") == 1
    assert sample(registry, "vllm:prompt_tokens_total") == 80
    assert sample(registry, "vllm:generation_tokens_total") == 12
    assert sample(registry, "vllm:gpu_prefix_cache_hits_total") == 48
    # Tokens per step: (40 prompt + 5 generated), then (40 + 7).
    assert sample(registry, "vllm:iteration_tokens_total_count") == 2
    assert sample(registry, "vllm:iteration_tokens_total_sum") == 92
    assert sample(registry, "vllm:iteration_tokens_total_bucket", le="32.0") == 0
    assert sample(registry, "vllm:iteration_tokens_total_bucket", le="64.0") == 2
    # A step that generated nothing (idle, or only prefill chunks) is no iteration sample.
    metrics.record_counters(EngineCounters(90, 48, 1, 80, 12))
    assert sample(registry, "vllm:iteration_tokens_total_count") == 2


def test_finished_request_latencies() -> None:
    metrics, registry = build()
    output = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2],
        outputs=[CompletionOutput(0, "abc", [5, 6, 7, 8, 9], finish_reason="length")],
        finished=True,
        metrics=RequestMetrics(
            arrival_time=10.0,
            first_scheduled_time=10.5,
            first_token_time=11.0,
            last_token_time=13.0,
            finished_time=13.0,
        ),
    )
    metrics.record_finished(output, finished_reason(output), SamplingParams(n=1, max_tokens=5))
    assert sample(registry, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(registry, "vllm:request_prefill_time_seconds_sum") == 0.5
    assert sample(registry, "vllm:request_decode_time_seconds_sum") == 2.0
    assert sample(registry, "vllm:request_inference_time_seconds_sum") == 2.5
    assert sample(registry, "vllm:time_per_prefill_token_request_seconds_sum") == 0.25
    assert sample(registry, "vllm:request_prompt_tokens_sum") == 2
    assert sample(registry, "vllm:request_generation_tokens_sum") == 5
    assert sample(registry, "kvpilot:request_max_num_generation_tokens_sum") == 5
    assert sample(registry, "vllm:request_params_max_tokens_sum") == 5
    assert sample(registry, "vllm:request_params_n_sum") == 1
    assert sample(registry, "vllm:request_prompt_tokens_bucket", le="1.0") == 0
    assert sample(registry, "vllm:request_prompt_tokens_bucket", le="2.0") == 1
    assert sample(registry, "vllm:request_success_total", finished_reason="stop") == 0
    assert sample(registry, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert sample(registry, "vllm:request_queue_time_seconds_sum") == 0.5
    assert sample(registry, "vllm:e2e_request_latency_seconds_sum") == 3.0
    # (13 - 11) s over the 4 tokens after the first.
    assert sample(registry, "vllm:time_per_output_token_seconds_sum") == 0.5
    assert sample(registry, "vllm:time_to_first_token_seconds_bucket", le="1.0") == 1
    assert sample(registry, "vllm:time_to_first_token_seconds_bucket", le="0.75") == 0


def test_n_choices_sum_their_tokens_and_the_longest_is_the_max() -> None:
    metrics, registry = build()
    choices = [CompletionOutput(0, "", [1, 2, 3]), CompletionOutput(1, "", [4])]
    output = RequestOutput("r", None, [7] * 30, choices, finished=True)
    metrics.record_finished(output, "stop", SamplingParams(n=2, max_tokens=None))
    assert sample(registry, "vllm:request_generation_tokens_sum") == 4
    assert sample(registry, "vllm:request_max_num_generation_tokens_sum") == 3
    assert sample(registry, "vllm:request_params_n_bucket", le="2.0") == 1
    assert sample(registry, "vllm:request_params_n_bucket", le="1.0") == 0
    assert sample(registry, "vllm:request_params_max_tokens_count") == 0  # no max_tokens given
    assert sample(registry, "vllm:request_prompt_tokens_bucket", le="50.0") == 1


def test_finished_reason_of_n_choices() -> None:
    def out(*reasons: str) -> RequestOutput:
        choices = [CompletionOutput(i, "", [], finish_reason=r) for i, r in enumerate(reasons)]
        return RequestOutput("r", None, [], choices, finished=True)

    assert finished_reason(out("stop", "stop")) == "stop"
    assert finished_reason(out("stop", "length")) == "length"
    assert finished_reason(out("length", "abort")) == "abort"


def parsed(text: str) -> list[tuple[str, str, str, tuple[tuple[str, str], ...], float]]:
    return sorted(
        (f.name, f.type, f.documentation, tuple(sorted(s.labels.items())), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
    )


def filled(
    vllm_names: bool = True, model_name: str = "m"
) -> tuple[ServerMetrics, CollectorRegistry]:
    metrics, registry = build(vllm_names, model_name)
    metrics.record_counters(EngineCounters(10, 4, 1, 30, 12))
    # On a bound (upper bounds are inclusive), between bounds, above every bound.
    for gap in (0.01, 0.02, 0.3, 123.0):
        metrics.inter_token_latency.observe(gap)
    metrics.engine_step_duration.observe(0.004)
    output = RequestOutput(
        "r", None, [1, 2, 3], [CompletionOutput(0, "a", [4, 5], finish_reason="stop")], True,
        metrics=RequestMetrics(1.0, 1.5, 2.0, 2.5, 2.5),
    )  # fmt: skip
    metrics.record_finished(output, "stop", SamplingParams(max_tokens=7))
    return metrics, registry


def test_the_fast_exposition_writes_what_generate_latest_writes() -> None:
    """/metrics' fast path and prometheus_client's exposition of the same registry parse to the
    same families, types, help texts and samples (values, labels, _created timestamps)."""
    for vllm_names in (True, False):
        metrics, registry = filled(vllm_names)
        fast, reference = (
            parsed(metrics.exposition().decode()),
            parsed(generate_latest(registry).decode()),
        )
        assert fast == reference
        assert len(fast) > 600 if vllm_names else len(fast) > 300
    # A model name that needs escaping in a label value comes back whole.
    metrics, registry = filled(model_name='a"b\\c\nd')
    fast = parsed(metrics.exposition().decode())
    assert fast == parsed(generate_latest(registry).decode())
    assert {dict(labels)["model_name"] for _, _, _, labels, _ in fast} == {'a"b\\c\nd'}


def test_histograms_bucket_as_prometheus_clients_own() -> None:
    """The same observations (random, and exactly on every bound) land in the same cumulative
    buckets, count and sum as in prometheus_client's Histogram."""

    from kvpilot.engine.server.histograms import Histogram

    registry = CollectorRegistry()
    theirs = ClientHistogram("x", "d", buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
    ours, shown = Histogram(TOKEN_LATENCY_BUCKETS), HistogramSet()
    shown.add(ours, "x", "d", [], [])
    rng = random.Random(7)
    values = [rng.uniform(0, 100) for _ in range(500)] + list(TOKEN_LATENCY_BUCKETS) + [0.0]
    for value in values:
        theirs.observe(value)
        ours.observe(value)
    want = [s for s in parsed(generate_latest(registry).decode()) if not s[0].endswith("created")]
    got = [s for s in parsed(shown.render()) if not s[0].endswith("created")]
    assert got == want and len(got) == 1 + len(TOKEN_LATENCY_BUCKETS) + 2


def test_bucket_bounds_must_increase() -> None:
    with pytest.raises(ValueError, match="must increase"):
        Histogram([1.0, 0.5])
    with pytest.raises(ValueError, match="must increase"):
        Histogram([1.0, 1.0])
