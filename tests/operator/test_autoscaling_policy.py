"""spec.autoscaling -> AutoscalingPolicy: defaults, camelCase fields, readable errors."""

from __future__ import annotations

import pytest

from kvpilot.operator.autoscaling import AutoscalingPolicy


def test_defaults() -> None:
    policy = AutoscalingPolicy.from_spec({"maxReplicas": 4})
    assert policy == AutoscalingPolicy(
        max_replicas=4,
        min_replicas=1,
        target_queue_depth=5.0,
        target_kv_cache_utilization=0.8,
        interval_s=5.0,
        stable_window_s=20.0,
        panic_window_s=10.0,
        panic_threshold=2.0,
        tolerance=0.1,
        scale_up_window_s=0.0,
        scale_down_window_s=300.0,
        scale_up_max_rate=2.0,
        scale_up_max_pods=4,
        scale_down_max_rate=2.0,
        startup_grace_s=600.0,
    )


def test_every_camel_case_field_is_read() -> None:
    spec = {
        "minReplicas": 2,
        "maxReplicas": 9,
        "targetQueueDepth": 8,
        "targetKVCacheUtilization": 0.9,
        "intervalSeconds": 2,
        "stableWindowSeconds": 30,
        "panicWindowSeconds": 4,
        "panicThreshold": 3,
        "tolerance": 0.2,
        "startupGraceSeconds": 900,
        "scaleUp": {"stabilizationWindowSeconds": 15, "maxRate": 3, "maxPodsPerStep": 2},
        "scaleDown": {"stabilizationWindowSeconds": 120, "maxRate": 4},
    }
    assert AutoscalingPolicy.from_spec(spec) == AutoscalingPolicy(
        min_replicas=2,
        max_replicas=9,
        target_queue_depth=8,
        target_kv_cache_utilization=0.9,
        interval_s=2,
        stable_window_s=30,
        panic_window_s=4,
        panic_threshold=3,
        tolerance=0.2,
        startup_grace_s=900,
        scale_up_window_s=15,
        scale_up_max_rate=3,
        scale_up_max_pods=2,
        scale_down_window_s=120,
        scale_down_max_rate=4,
    )


def test_nulls_take_the_defaults() -> None:
    """A pydantic model dumped without exclude_none writes nulls for unset fields."""
    spec = {"maxReplicas": 3, "targetQueueDepth": None, "scaleUp": None, "scaleDown": {}}
    assert AutoscalingPolicy.from_spec(spec) == AutoscalingPolicy(max_replicas=3)


def test_replica_counts_are_ints() -> None:
    policy = AutoscalingPolicy.from_spec({"maxReplicas": 4.0, "minReplicas": 2.0})
    assert type(policy.max_replicas) is int and type(policy.min_replicas) is int


def test_the_operator_crd_model_dumps_what_the_policy_reads() -> None:
    """The CRD's pydantic model (operator/spec.py) and this parser agree on every field."""
    from kvpilot.operator.spec import AutoscalingSpec

    spec = {
        "minReplicas": 2,
        "maxReplicas": 9,
        "targetQueueDepth": 8,
        "targetKVCacheUtilization": 0.9,
        "intervalSeconds": 2,
        "stableWindowSeconds": 30,
        "panicWindowSeconds": 4,
        "panicThreshold": 3,
        "tolerance": 0.2,
        "startupGraceSeconds": 900,
        "scaleUp": {"stabilizationWindowSeconds": 15, "maxRate": 3, "maxPodsPerStep": 2},
        "scaleDown": {"stabilizationWindowSeconds": 120, "maxRate": 4},
    }
    for dumped in (
        AutoscalingSpec.model_validate(spec).model_dump(by_alias=True),
        AutoscalingSpec.model_validate(spec).model_dump(by_alias=True, exclude_none=True),
    ):
        assert AutoscalingPolicy.from_spec(dumped) == AutoscalingPolicy.from_spec(spec)
    minimal = AutoscalingSpec.model_validate({"maxReplicas": 3}).model_dump(by_alias=True)
    assert AutoscalingPolicy.from_spec(minimal) == AutoscalingPolicy(max_replicas=3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "autoscaling.maxReplicas is required"),
        ({"maxReplicas": 2, "minReplicas": -1}, "minReplicas must be >= 0"),
        ({"maxReplicas": 2, "minReplicas": 3}, r"maxReplicas \(2\) must be >= minReplicas \(3\)"),
        ({"maxReplicas": 2.5}, "autoscaling.maxReplicas must be an integer"),
        ({"maxReplicas": True}, "autoscaling.maxReplicas must be a number"),
        ({"maxReplicas": "4"}, "autoscaling.maxReplicas must be a number"),
        ({"maxReplicas": 4, "targetQueueDepth": 0}, "targetQueueDepth must be > 0"),
        ({"maxReplicas": 4, "targetKVCacheUtilization": 80}, r"a fraction in \(0, 1\]"),
        ({"maxReplicas": 4, "targetQueueDepth": float("nan")}, "must be finite"),
        ({"maxReplicas": 4, "intervalSeconds": 0}, "intervalSeconds must be > 0"),
        ({"maxReplicas": 4, "panicWindowSeconds": 30}, "panicWindowSeconds.*stableWindowSeconds"),
        ({"maxReplicas": 4, "panicThreshold": 1.05}, "panicThreshold.*must exceed 1 \\+ tol"),
        ({"maxReplicas": 4, "tolerance": 1}, r"tolerance must be in \[0, 1\)"),
        ({"maxReplicas": 4, "scaleDown": {"stabilizationWindowSeconds": -1}}, "scaleDown.stab"),
        ({"maxReplicas": 4, "scaleUp": {"maxRate": 1}}, "maxRate must be > 1"),
        ({"maxReplicas": 4, "scaleUp": {"maxPodsPerStep": 0}}, "maxPodsPerStep must be >= 1"),
        ({"maxReplicas": 4, "scaleUp": 5}, "autoscaling.scaleUp must be an object"),
        ({"maxReplicas": 4, "targetQueueDepht": 5}, r"unknown field\(s\) \['targetQueueDepht'\]"),
        ({"maxReplicas": 4, "scaleDown": {"window": 5}}, r"autoscaling.scaleDown: unknown"),
    ],
)
def test_bad_specs_are_rejected_with_a_clear_message(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoscalingPolicy.from_spec(spec)


def test_not_an_object() -> None:
    with pytest.raises(ValueError, match="autoscaling must be an object, got list"):
        AutoscalingPolicy.from_spec([])  # type: ignore[arg-type]


def test_saturation_is_the_larger_of_queue_and_cache() -> None:
    policy = AutoscalingPolicy(
        max_replicas=2, target_queue_depth=4, target_kv_cache_utilization=0.5
    )
    assert policy.saturation(num_waiting=2, kv_cache_usage=0.1) == 0.5
    assert policy.saturation(num_waiting=2, kv_cache_usage=0.4) == 0.8
    assert policy.saturation(num_waiting=12, kv_cache_usage=1.0) == 3.0
