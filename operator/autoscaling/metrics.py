"""The operator's own Prometheus metrics, on a registry the caller owns (no global registry)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.contract.prometheus import Family
from kvpilot.operator.autoscaling.scrape import SCRAPE_ERROR_KINDS

# Reconciles talk to the API server; autoscaler ticks scrape pods with a ~1 s timeout.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RESOURCE_LABELS = ("namespace", "inferenceservice")

SCALE_DECISIONS = Family(
    Counter,
    "kvpilot_operator_scale_decisions",
    "Scale decisions that changed a Deployment's replicas, by direction (up/down).",
    (*RESOURCE_LABELS, "direction"),
)
SCRAPE_ERRORS = Family(
    Counter,
    "kvpilot_operator_scrape_errors",
    "Failed scrapes of engine /metrics, by kind (timeout, connect, http_status, parse...).",
    (*RESOURCE_LABELS, "kind"),
)
AUTOSCALE_TICK_DURATION = Family(
    Histogram,
    "kvpilot_operator_autoscale_tick_duration_seconds",
    "Duration of one autoscaler tick: scrape all Ready pods and decide.",
    (),
    buckets=DURATION_BUCKETS,
)
RECONCILE_DURATION = Family(
    Histogram,
    "kvpilot_operator_reconcile_duration_seconds",
    "Duration of one reconcile of an InferenceService.",
    (),
    buckets=DURATION_BUCKETS,
)
DESIRED_REPLICAS = Family(
    Gauge,
    "kvpilot_operator_desired_replicas",
    "Replicas the autoscaler wants for an InferenceService.",
    RESOURCE_LABELS,
)
LOAD = Family(
    Gauge,
    "kvpilot_operator_load",
    "Summed saturation of an InferenceService's Ready pods (1.0 = one pod at target).",
    RESOURCE_LABELS,
)
PANIC = Family(
    Gauge,
    "kvpilot_operator_panic",
    "1 while the autoscaler of an InferenceService is in panic mode.",
    RESOURCE_LABELS,
)
# What dashboards and alerts compare desired_replicas with.
CURRENT_REPLICAS = Family(
    Gauge,
    "kvpilot_operator_current_replicas",
    "The Deployment's replicas an autoscaler tick found.",
    RESOURCE_LABELS,
)
MAX_REPLICAS = Family(
    Gauge,
    "kvpilot_operator_max_replicas",
    "spec.autoscaling.maxReplicas of an InferenceService.",
    RESOURCE_LABELS,
)
SATURATION = Family(
    Gauge,
    "kvpilot_operator_saturation",
    "Mean saturation per Ready pod (1.0 = at target) of an InferenceService.",
    RESOURCE_LABELS,
)
RECONCILE_ERRORS = Family(
    Counter,
    "kvpilot_operator_reconcile_errors",
    "Reconciles that failed (API errors, retried by kopf with backoff).",
    RESOURCE_LABELS,
)
DEGRADED = Family(
    Gauge,
    "kvpilot_operator_degraded",
    "1 while an InferenceService's Degraded condition is True, labelled with its reason.",
    (*RESOURCE_LABELS, "reason"),
)


class OperatorMetrics:
    """Scale decisions, scrape errors, durations, and the autoscaler's view per InferenceService.

    Serve it with prometheus_client.start_http_server(port, registry=registry).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.scale_decisions = SCALE_DECISIONS.declare(registry)
        self.scrape_errors = SCRAPE_ERRORS.declare(registry)
        self.autoscale_tick_duration = AUTOSCALE_TICK_DURATION.declare(registry)
        self.reconcile_duration = RECONCILE_DURATION.declare(registry)
        self.desired_replicas = DESIRED_REPLICAS.declare(registry)
        self.load = LOAD.declare(registry)
        self.panic = PANIC.declare(registry)
        self.current_replicas = CURRENT_REPLICAS.declare(registry)
        self.max_replicas = MAX_REPLICAS.declare(registry)
        self.saturation = SATURATION.declare(registry)
        self.reconcile_errors = RECONCILE_ERRORS.declare(registry)
        self.degraded = DEGRADED.declare(registry)
        self._degraded_reasons: dict[tuple[str, str], str] = {}

    def set_degraded(self, namespace: str, name: str, reason: str | None) -> None:
        """The one series of the current Degraded reason (None: not degraded, no series)."""
        previous = self._degraded_reasons.pop((namespace, name), None)
        if previous is not None and previous != reason:
            with contextlib.suppress(KeyError):
                self.degraded.remove(namespace, name, previous)
        if reason is not None:
            self.degraded.labels(namespace, name, reason).set(1)
            self._degraded_reasons[(namespace, name)] = reason

    def forget(self, namespace: str, name: str) -> None:
        """Drops the per-InferenceService series once it is deleted."""
        gauges = (
            self.desired_replicas,
            self.load,
            self.panic,
            self.current_replicas,
            self.max_replicas,
            self.saturation,
        )
        for gauge in gauges:
            with contextlib.suppress(KeyError):  # never set for this resource
                gauge.remove(namespace, name)
        series = [(self.scale_decisions, d) for d in ("up", "down")]
        series += [(self.scrape_errors, kind) for kind in SCRAPE_ERROR_KINDS]
        for counter, value in series:
            with contextlib.suppress(KeyError):
                counter.remove(namespace, name, value)

    def forget_resource(self, namespace: str, name: str) -> None:
        """Drops every series of an InferenceService that is gone (forget: only the
        autoscaler's, for one that stopped autoscaling)."""
        self.forget(namespace, name)
        self.set_degraded(namespace, name, None)
        with contextlib.suppress(KeyError):
            self.reconcile_errors.remove(namespace, name)
