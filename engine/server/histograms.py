"""Histograms kept as plain counts and written out as Prometheus text in one pass.

Why not prometheus_client's Histogram: a scrape builds a Sample object per bucket (each read under
its own lock) and formats each one's labels anew: ~4.5 ms of the event loop for the ~800 bucket
lines of ServerMetrics' 23 histograms under two name sets. The Gateway API Inference Extension's
endpoint picker scrapes every model server's /metrics every 50 ms by default, so that was ~10 % of
the API process's event loop, and stalls of that length in every stream. Here every line's name
and labels are formatted once, at start; a scrape copies each histogram's counts and writes
numbers. Each logical histogram is one set of counts shown under every name set, so `kvpilot:`
and `vllm:` can never disagree (and an observation costs one bisect, not one per name set).

The same set is also a prometheus_client collector (registered on the server's registry), so
anything that reads the registry (generate_latest, get_sample_value) sees the same histograms.
Observations come from one thread (the API process's output thread) and scrapes from another: a
scrape copies the counts list in one step (the interpreter lock makes that atomic), so its buckets
and count agree; its sum may miss an observation made meanwhile.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class Histogram:
    """Counts of observations per bucket (upper bounds inclusive, then +Inf) and their sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"bucket bounds must increase: {bounds}")
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


@dataclass(frozen=True)
class _Shown:
    """One histogram under one name, with its label values."""

    histogram: Histogram
    name: str
    doc: str
    label_names: tuple[str, ...]
    label_values: tuple[str, ...]
    les: tuple[str, ...]  # each bucket's `le` label, +Inf last
    # Written once: the family's header lines and each line's start up to its value.
    header: str
    bucket_starts: tuple[str, ...]
    count_start: str
    sum_start: str
    created_block: str  # the _created family's header and its line's start


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else ""


def _doc(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


class HistogramSet:
    """Histograms shown under one or more names each; a prometheus_client collector too."""

    def __init__(self) -> None:
        self._shown: list[_Shown] = []

    def add(
        self,
        histogram: Histogram,
        name: str,
        doc: str,
        label_names: Sequence[str],
        label_values: Sequence[str],
    ) -> None:
        """Show `histogram` as `name` with these labels (call before scrapes start)."""
        pairs = list(zip(label_names, label_values, strict=True))
        les = [floatToGoString(b) for b in histogram.bounds] + ["+Inf"]
        header = f"# HELP {name} {_doc(doc)}\n# TYPE {name} histogram\n"
        created_name = f"{name}_created"
        self._shown.append(
            _Shown(
                histogram,
                name,
                doc,
                tuple(label_names),
                tuple(label_values),
                tuple(les),
                header,
                tuple(f"{name}_bucket{_labels([*pairs, ('le', le)])} " for le in les),
                f"{name}_count{_labels(pairs)} ",
                f"{name}_sum{_labels(pairs)} ",
                f"# HELP {created_name} {_doc(doc)}\n# TYPE {created_name} gauge\n"
                f"{created_name}{_labels(pairs)} ",
            )
        )

    def render(self) -> str:
        """Every histogram in the Prometheus text format (0.0.4), as generate_latest writes it."""
        out: list[str] = []
        for shown in self._shown:
            hist = shown.histogram
            counts, total = list(hist.counts), hist.sum  # copied first: one consistent set
            out.append(shown.header)
            cumulative = list(itertools.accumulate(counts))
            for start, value in zip(shown.bucket_starts, cumulative, strict=True):
                out.append(f"{start}{floatToGoString(value)}\n")
            out.append(f"{shown.count_start}{floatToGoString(cumulative[-1])}\n")
            out.append(f"{shown.sum_start}{floatToGoString(total)}\n")
            out.append(f"{shown.created_block}{floatToGoString(hist.created)}\n")
        return "".join(out)

    # ---- prometheus_client's collector interface ------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        for shown in self._shown:
            hist = shown.histogram
            counts, total = list(hist.counts), hist.sum
            family = HistogramMetricFamily(shown.name, shown.doc, labels=list(shown.label_names))
            family.add_metric(
                list(shown.label_values),
                list(zip(shown.les, itertools.accumulate(counts), strict=True)),
                total,
            )
            labels = dict(zip(shown.label_names, shown.label_values, strict=True))
            family.samples.append(Sample(f"{shown.name}_created", labels, hist.created))
            yield family

    def describe(self) -> Iterator[Metric]:
        """The names, for the registry's duplicate check (no values)."""
        for shown in self._shown:
            yield HistogramMetricFamily(shown.name, shown.doc, labels=list(shown.label_names))
