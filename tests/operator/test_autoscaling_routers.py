"""What the kvpilot routers hold per InferenceService: their /metrics parsed, and real router
metrics registries scraped over loopback HTTP, summed over the routers, once per round."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.operator.autoscaling import MetricsScraper
from kvpilot.operator.autoscaling.routers import (
    RouterCounts,
    RouterLoad,
    parse_router_metrics,
    router_port,
    router_targets,
)
from kvpilot.operator.autoscaling.scrape import MetricsParseError
from kvpilot.router.metrics import RouterMetrics

from .autoscaling_helpers import router_pod_dict, serve_routers


def router_text(*holds: tuple[str, str, str, float, float]) -> str:
    metrics = RouterMetrics(CollectorRegistry())
    for model, namespace, name, held, in_flight in holds:
        metrics.held.labels(model, namespace, name).set(held)
        metrics.in_flight.labels(model, namespace, name).set(in_flight)
    return generate_latest(metrics.registry).decode()


def test_parses_held_and_in_flight_per_inferenceservice() -> None:
    text = router_text(("chat", "team-a", "chat", 3, 7), ("code", "team-b", "coder", 0, 2))
    assert parse_router_metrics(text) == {
        ("team-a", "chat"): RouterCounts(held=3, in_flight=7),
        ("team-b", "coder"): RouterCounts(held=0, in_flight=2),
    }


def test_series_without_the_service_labels_and_other_metrics_are_ignored() -> None:
    text = (
        "# TYPE kvpilot_router_held_requests gauge\n"
        'kvpilot_router_held_requests{model="chat"} 4.0\n'
        "# TYPE kvpilot_router_replicas gauge\n"
        'kvpilot_router_replicas{model="chat",state="routable"} 2.0\n'
    )
    assert parse_router_metrics(text) == {}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<html>502 Bad Gateway</html>", "not Prometheus text"),
        (
            'kvpilot_router_held_requests{namespace="a",inferenceservice="b"} -1\n',
            "invalid value",
        ),
    ],
)
def test_bad_router_text_is_an_error(text: str, error: str) -> None:
    with pytest.raises(MetricsParseError, match=error):
        parse_router_metrics(text)


def test_targets_are_the_ready_router_pods_at_their_http_port() -> None:
    pods = [
        router_pod_dict("router-a", "10.0.0.1", 8080),
        router_pod_dict("router-b", "10.0.0.2", 9000, is_ready=False),
        router_pod_dict("router-c", None, 8080),
    ]
    deleting = router_pod_dict("router-d", "10.0.0.4", 8080)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    targets = router_targets([*pods, deleting])
    assert [(t.name, t.url) for t in targets] == [
        ("router-a", "http://10.0.0.1:8080/metrics"),
        ("router-c", None),  # Ready without an IP: an error when scraped, not skipped silently
    ]
    assert router_port({"spec": {"containers": [{"name": "router"}]}}) == 8080


async def test_sums_live_routers_once_per_round_and_leaves_out_a_failing_one() -> None:
    now = [0.0]
    async with serve_routers(3) as served:
        pods = [
            router_pod_dict(f"router-{i}", "127.0.0.1", port) for i, (_, port) in enumerate(served)
        ]
        listings = 0

        async def list_pods() -> list[dict[str, Any]]:
            nonlocal listings
            listings += 1
            return pods

        (a, _), (b, _), (c, _) = served
        a.hold("chat", "serving", "chat", held=2, in_flight=5)
        b.hold("chat", "serving", "chat", held=3, in_flight=1)
        c.mode = "error"
        scraper = MetricsScraper(timeout_s=2.0)
        try:
            load = RouterLoad(list_pods, scraper.fetch_text, max_age_s=2.5, clock=lambda: now[0])
            # Services ticking at once share one listing and one scrape of each router.
            snapshots = await asyncio.gather(*(load.snapshot() for _ in range(4)))
            assert listings == 1 and (a.num_scrapes, b.num_scrapes) == (1, 1)
            snapshot = snapshots[0]
            assert snapshot.num_reporting == 2
            assert snapshot.errors["router-2"].kind == "http_status"
            assert snapshot.for_service("serving", "chat") == RouterCounts(held=5, in_flight=6)
            assert snapshot.for_service("serving", "other") == RouterCounts()

            # Within max_age the same snapshot; after it, a fresh scrape sees the change.
            a.hold("chat", "serving", "chat", held=0, in_flight=0)
            now[0] = 2.0
            assert (await load.snapshot()).for_service("serving", "chat").held == 5
            now[0] = 3.0
            fresh = await load.snapshot()
            assert fresh.for_service("serving", "chat") == RouterCounts(held=3, in_flight=1)
            assert listings == 2
        finally:
            await scraper.aclose()


async def test_no_router_reporting_is_unknown_not_zero() -> None:
    async def no_api() -> list[dict[str, Any]]:
        raise RuntimeError("the API is down")

    scraper = MetricsScraper(timeout_s=1.0)
    try:
        load = RouterLoad(no_api, scraper.fetch_text, max_age_s=1.0)
        assert (await load.snapshot()).for_service("serving", "chat") is None
    finally:
        await scraper.aclose()
