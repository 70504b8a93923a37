"""Parsing engine metrics, and scraping real prometheus_client registries over loopback HTTP."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kvpilot.operator.autoscaling import MetricsScraper, PodMetrics, ScrapeError, parse_metrics
from kvpilot.operator.autoscaling.scrape import MetricsParseError, ScrapeTarget, metrics_url

from .autoscaling_helpers import serve_pods


def exposition(**gauges: dict[str, float]) -> str:
    """Prometheus text from a real registry: name -> {model_name: value}."""
    registry = CollectorRegistry()
    for name, by_model in gauges.items():
        gauge = Gauge(name.replace("__", ":"), "doc", ["model_name"], registry=registry)
        for model, value in by_model.items():
            gauge.labels(model_name=model).set(value)
    return generate_latest(registry).decode()


def test_prefers_kvpilot_names_over_the_vllm_aliases() -> None:
    text = exposition(
        kvpilot__num_requests_waiting={"m": 3},
        kvpilot__num_requests_running={"m": 7},
        kvpilot__kv_cache_usage_perc={"m": 0.5},
        vllm__num_requests_waiting={"m": 99},
        vllm__num_requests_running={"m": 99},
        vllm__kv_cache_usage_perc={"m": 0.99},
    )
    assert parse_metrics(text) == PodMetrics(num_waiting=3, kv_cache_usage=0.5, num_running=7)


@pytest.mark.parametrize("kv_name", ["vllm__kv_cache_usage_perc", "vllm__gpu_cache_usage_perc"])
def test_falls_back_to_vllm_names(kv_name: str) -> None:
    text = exposition(vllm__num_requests_waiting={"m": 4}, **{kv_name: {"m": 0.25}})
    assert parse_metrics(text) == PodMetrics(num_waiting=4, kv_cache_usage=0.25, num_running=None)


def test_sums_counts_over_models_and_takes_the_fullest_cache() -> None:
    text = exposition(
        kvpilot__num_requests_waiting={"base": 2, "lora-a": 5},
        kvpilot__num_requests_running={"base": 1, "lora-a": 2},
        kvpilot__kv_cache_usage_perc={"base": 0.3, "lora-a": 0.6},
    )
    assert parse_metrics(text) == PodMetrics(num_waiting=7, kv_cache_usage=0.6, num_running=3)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<html><body>502 Bad Gateway</body></html>", "not Prometheus text"),
        ('kvpilot:num_requests_waiting{model_name="m"} {{{\n', "not Prometheus text"),
        (exposition(kvpilot__kv_cache_usage_perc={"m": 0.5}), "no kvpilot:num_requests_waiting"),
        (exposition(kvpilot__num_requests_waiting={"m": 1}), "no kvpilot:kv_cache_usage_perc"),
        ("", "no kvpilot:num_requests_waiting"),
        (
            exposition(
                kvpilot__num_requests_waiting={"m": float("nan")},
                kvpilot__kv_cache_usage_perc={"m": 0.5},
            ),
            "invalid value nan",
        ),
        (
            exposition(
                kvpilot__num_requests_waiting={"m": -1},
                kvpilot__kv_cache_usage_perc={"m": 0.5},
            ),
            "invalid value -1",
        ),
        (
            exposition(
                kvpilot__num_requests_waiting={"m": 1},
                kvpilot__kv_cache_usage_perc={"m": 85},  # a percentage, not a fraction
            ),
            "above 1",
        ),
    ],
)
def test_bad_text_is_an_error_never_zero(text: str, error: str) -> None:
    with pytest.raises(MetricsParseError, match=error):
        parse_metrics(text)


def test_metrics_url() -> None:
    assert metrics_url("10.1.2.3", 8000) == "http://10.1.2.3:8000/metrics"
    assert metrics_url("fd00::12", 8000) == "http://[fd00::12]:8000/metrics"
    assert metrics_url(None, 8000) is None
    assert metrics_url("", 8000) is None


async def test_scrapes_live_registries_and_sees_changes() -> None:
    async with serve_pods(2) as (pods, port):
        scraper = MetricsScraper(timeout_s=2.0)
        targets = [ScrapeTarget(p.name, metrics_url(p.host, port)) for p in pods]
        pods[0].set(waiting=3, kv=0.4, running=5)
        pods[1].set(waiting=0, kv=0.1, running=1)
        first = await scraper(targets)
        pods[0].set(waiting=12, kv=0.95, running=16)
        second = await scraper(targets)
        await scraper.aclose()
    assert first == {
        "engine-0": PodMetrics(num_waiting=3, kv_cache_usage=0.4, num_running=5),
        "engine-1": PodMetrics(num_waiting=0, kv_cache_usage=0.1, num_running=1),
    }
    assert second["engine-0"] == PodMetrics(num_waiting=12, kv_cache_usage=0.95, num_running=16)
    assert [p.num_scrapes for p in pods] == [2, 2]


async def test_a_vllm_only_server_is_read_through_the_aliases() -> None:
    async with serve_pods(1, prefixes=("vllm",)) as (pods, port):
        pods[0].set(waiting=6, kv=0.7, running=3)
        async with httpx.AsyncClient() as client:
            scraper = MetricsScraper(client, timeout_s=2.0)
            result = await scraper([ScrapeTarget("v", metrics_url(pods[0].host, port))])
    assert result == {"v": PodMetrics(num_waiting=6, kv_cache_usage=0.7, num_running=3)}


async def test_failures_are_errors_and_scrapes_run_concurrently() -> None:
    async with serve_pods(6) as (pods, port):
        pods[0].set(waiting=1, kv=0.5)
        pods[1].mode = "slow"
        pods[2].mode = "error"
        pods[3].mode = "garbage"
        pods[4].mode = "slow"
        pods[5].mode = "slow"
        targets = [ScrapeTarget(p.name, metrics_url(p.host, port)) for p in pods]
        targets += [
            # Nothing listens there: 127.0.0.1-6 took the port, so no wildcard socket holds it.
            ScrapeTarget("refused", metrics_url("127.0.0.200", port)),
            ScrapeTarget("no-ip", None),
        ]
        scraper = MetricsScraper(timeout_s=0.3)
        started = time.perf_counter()
        results = await scraper(targets)
        elapsed = time.perf_counter() - started
        await scraper.aclose()
    assert results["engine-0"] == PodMetrics(num_waiting=1, kv_cache_usage=0.5, num_running=0)
    kinds = {name: r.kind for name, r in results.items() if isinstance(r, ScrapeError)}
    assert kinds == {
        "engine-1": "timeout",
        "engine-2": "http_status",
        "engine-3": "parse",
        "engine-4": "timeout",
        "engine-5": "timeout",
        "refused": "connect",
        "no-ip": "no_ip",
    }
    assert "HTTP 500" in results["engine-2"].detail  # type: ignore[union-attr]
    # Three slow pods time out in parallel: one timeout (0.3 s), not three in a row (0.9 s).
    assert elapsed < 0.75


async def test_oversized_answers_are_cut_off() -> None:
    async with serve_pods(1) as (pods, port):
        scraper = MetricsScraper(timeout_s=2.0, max_body_bytes=64)
        result = await scraper([ScrapeTarget("big", metrics_url(pods[0].host, port))])
        await scraper.aclose()
    assert isinstance(result["big"], ScrapeError)
    assert result["big"].kind == "too_large"


def test_scraper_rejects_a_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        MetricsScraper(timeout_s=0)


@pytest.mark.parametrize("vllm_names", [True, False])
def test_reads_what_the_kvpilot_engine_exports(vllm_names: bool) -> None:
    """The contract with engine/server/metrics.py: its real registry, parsed by the autoscaler."""
    from kvpilot.engine.server.metrics import ServerMetrics

    registry = CollectorRegistry()
    metrics = ServerMetrics(
        registry,
        "smollm2",
        block_size=16,
        num_gpu_blocks=64,
        enable_prefix_caching=True,
        max_model_len=2048,
        vllm_names=vllm_names,
    )
    metrics.num_requests_waiting.set(4)
    metrics.num_requests_running.set(2)
    metrics.kv_cache_usage.set(0.5)
    text = generate_latest(registry).decode()
    assert parse_metrics(text) == PodMetrics(num_waiting=4, kv_cache_usage=0.5, num_running=2)
