"""Autoscaling of InferenceServices on the engine's own queue depth and KV-cache utilization."""

from __future__ import annotations

from kvpilot.operator.autoscaling.decide import Decision, decide
from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.autoscaling.observations import Observations, PodMetrics, PodSample
from kvpilot.operator.autoscaling.pods import PodCensus, count_pods
from kvpilot.operator.autoscaling.policy import AutoscalingPolicy
from kvpilot.operator.autoscaling.scrape import (
    MetricsScraper,
    Scrape,
    ScrapeError,
    ScrapeTarget,
    parse_metrics,
)
from kvpilot.operator.autoscaling.state import AutoscalerState, DecisionRecord
from kvpilot.operator.autoscaling.tick import (
    EventSpec,
    TickResult,
    autoscale_tick,
    build_status_patch,
    is_tick_due,
)

__all__ = [
    "AutoscalerState",
    "AutoscalingPolicy",
    "Decision",
    "DecisionRecord",
    "EventSpec",
    "MetricsScraper",
    "Observations",
    "OperatorMetrics",
    "PodCensus",
    "PodMetrics",
    "PodSample",
    "Scrape",
    "ScrapeError",
    "ScrapeTarget",
    "TickResult",
    "autoscale_tick",
    "build_status_patch",
    "count_pods",
    "decide",
    "is_tick_due",
    "parse_metrics",
]
