"""One way to declare a Prometheus metric family: a row that says what its scrapers read.

A scraper (Prometheus, KEDA, the Gateway API Inference Extension, the operator's autoscaler, a
dashboard) depends on a family's name, type, help text, label names and, for a histogram, its
bucket bounds. `Family` is exactly those, so each component's metrics read as one table of rows,
and `Family.declare` registers one on a registry the caller owns (never the global one, so tests
and several servers in one process do not collide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Metric = TypeVar("Metric", Counter, Gauge, Histogram)


@dataclass(frozen=True)
class Family(Generic[Metric]):
    """A metric family: its prometheus_client type, name (a counter's samples add `_total`),
    help text, label names in the order `.labels(...)` takes their values, and a histogram's
    bucket upper bounds (+Inf is added; None: the owner supplies them when it declares)."""

    kind: type[Metric]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.buckets is not None and self.kind is not Histogram:
            raise ValueError(f"{self.name}: only a histogram has buckets")

    def declare(self, registry: CollectorRegistry) -> Metric:
        """Register the family on `registry` (ValueError if a name there is already taken)."""
        extra: dict[str, Any] = {} if self.buckets is None else {"buckets": self.buckets}
        return self.kind(self.name, self.doc, self.labels, registry=registry, **extra)
