"""The operator's per-InferenceService series that alerts read: the current Degraded reason and
reconcile errors, recorded by a real Reconciler and dropped when the object goes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.kube import KubeError
from kvpilot.operator.reconcile import Reconciler

from .test_autoscaler import MemoryApi, isvc


def series(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(
        name, {"namespace": "serving", "inferenceservice": "chat", **labels}
    )


def test_one_series_for_the_current_degraded_reason() -> None:
    metrics = OperatorMetrics(CollectorRegistry())
    metrics.set_degraded("serving", "chat", "CrashLoopBackOff")
    metrics.set_degraded("serving", "chat", "OOMKilled")
    registry = metrics.registry
    assert series(registry, "kvpilot_operator_degraded", reason="OOMKilled") == 1
    assert series(registry, "kvpilot_operator_degraded", reason="CrashLoopBackOff") is None
    metrics.set_degraded("serving", "chat", None)
    assert series(registry, "kvpilot_operator_degraded", reason="OOMKilled") is None


def test_reconcile_records_an_invalid_spec_and_api_errors() -> None:
    metrics = OperatorMetrics(CollectorRegistry())
    broken = isvc(2, panicWindowSeconds=30)  # panic window > stable window: InvalidSpec
    api = MemoryApi(broken, None)
    reconciler = Reconciler(api, OperatorConfig(), lambda *_: None, metrics=metrics)  # type: ignore[arg-type]
    assert reconciler.reconcile(broken).invalid is not None
    registry = metrics.registry
    assert series(registry, "kvpilot_operator_degraded", reason="InvalidSpec") == 1

    api.fail_on = "get_inferenceservice"
    for _ in range(2):
        try:
            reconciler.reconcile(broken)
        except KubeError:
            pass
        else:
            raise AssertionError("the API error must reach kopf, which retries")
    assert series(registry, "kvpilot_operator_reconcile_errors_total") == 2

    api.fail_on, api.body = None, None  # deleted: every series of it goes
    reconciler.reconcile(broken)
    assert series(registry, "kvpilot_operator_degraded", reason="InvalidSpec") is None
    assert series(registry, "kvpilot_operator_reconcile_errors_total") is None
