"""Family: one row declares a prometheus_client metric on the caller's registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.contract.prometheus import Family


def test_declare_registers_the_row_on_the_given_registry() -> None:
    registry = CollectorRegistry()
    counter = Family(Counter, "c", "Things.", ("kind",)).declare(registry)
    histogram = Family(Histogram, "h", "Sizes.", buckets=(1.0, 5.0)).declare(registry)
    counter.labels("a").inc(2)
    histogram.observe(3.0)
    assert registry.get_sample_value("c_total", {"kind": "a"}) == 2
    assert registry.get_sample_value("h_bucket", {"le": "1.0"}) == 0
    assert registry.get_sample_value("h_bucket", {"le": "5.0"}) == 1
    # Never the global registry; a name is taken once per registry.
    with pytest.raises(ValueError, match="Duplicated"):
        Family(Gauge, "c", "Again.").declare(registry)
    Family(Gauge, "c", "Again.").declare(CollectorRegistry())


def test_only_a_histogram_has_buckets() -> None:
    with pytest.raises(ValueError, match="only a histogram"):
        Family(Gauge, "g", "Level.", buckets=(1.0,))
