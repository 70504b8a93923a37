from __future__ import annotations

import re
from typing import Any

import pytest

from kvpilot.operator.spec import (
    InvalidSpecError,
    parse_spec,
    validate_name,
)

MODEL = {"uri": "builtin://smollm2-135m-instruct"}


def spec(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, **fields}


def test_defaults_of_a_minimal_spec() -> None:
    parsed = parse_spec(spec())
    assert parsed.effective_replicas == 1
    assert parsed.engine.enable_prefix_caching is True
    assert parsed.engine.startup_timeout_seconds == 1800
    assert (parsed.rollout.max_surge, parsed.rollout.max_unavailable) == (1, 0)
    assert parsed.drain_seconds == 300
    assert parsed.gpus == 0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            spec(replicas=2, autoscaling={"maxReplicas": 3}),
            "spec: spec.replicas and spec.autoscaling are mutually exclusive",
        ),
        (spec(replicas=-1), "spec.replicas: Input should be greater than or equal to 0"),
        ({"model": {"uri": "s3://b/m"}}, "spec.model.uri: model uri 's3://b/m' has the unknown"),
        ({}, "spec.model: Field required"),
        (spec(replica=1), "spec.replica: Extra inputs are not permitted"),
        (spec(engine={"blockSize": 0}), "spec.engine.blockSize: Input should be 8, 16, 32, 64"),
        (
            spec(engine={"gpuMemoryUtilization": 1.5}),
            "spec.engine.gpuMemoryUtilization: Input should be less than or equal to 1",
        ),
        (spec(engine={"dtype": "fp8"}), "spec.engine.dtype: Input should be 'auto'"),
        (
            spec(engine={"extraArgs": ["--port", "9000"]}),
            "extraArgs may not set --port",
        ),
        (spec(engine={"extraArgs": ["--model=/x"]}), "extraArgs may not set --model"),
        (
            spec(engine={"extraArgs": ["--swap-space=4"]}),
            "spec.engine.extraArgs: `kvpilot serve` would refuse them: unrecognized arguments",
        ),
        # Strict types, as the CRD's schema: no "yes" for true, no "8" for 8.
        (
            spec(engine={"enablePrefixCaching": "yes"}),
            "spec.engine.enablePrefixCaching: Input should be a valid boolean",
        ),
        (spec(engine={"maxNumSeqs": "8"}), "spec.engine.maxNumSeqs: Input should be a valid int"),
        (
            spec(engine={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
            "env names must be unique, repeated: A",
        ),
        (
            spec(resources={"limits": {"memory": "lots"}}),
            "spec.resources.limits.memory: 'lots' is not a Kubernetes quantity",
        ),
        (
            spec(gpus=1, resources={"limits": {"nvidia.com/gpu": 2}}),
            "contradicts gpus = 1",
        ),
        (
            spec(podLabels={"app.kubernetes.io/instance": "x"}),
            "podLabels may not set app.kubernetes.io/instance",
        ),
        (
            spec(autoscaling={"minReplicas": 3, "maxReplicas": 2}),
            "spec.autoscaling: minReplicas (3) must be <= maxReplicas (2)",
        ),
        (spec(autoscaling={"minReplicas": 1}), "spec.autoscaling.maxReplicas: Field required"),
        (
            spec(autoscaling={"maxReplicas": 2, "targetKVCacheUtilization": 2}),
            "spec.autoscaling.targetKVCacheUtilization: Input should be less than or equal",
        ),
        (
            spec(autoscaling={"maxReplicas": 2, "stableWindowSeconds": 5}),
            "spec.autoscaling: need 0 < panicWindowSeconds (10.0) <= stableWindowSeconds (5.0)",
        ),
        (
            spec(autoscaling={"maxReplicas": 2, "panicThreshold": 1.05}),
            "spec.autoscaling: panicThreshold (1.05) must exceed 1 + tolerance (1.1)",
        ),
        (
            spec(rollout={"maxSurge": 0, "maxUnavailable": "0%"}),
            "maxSurge and rollout.maxUnavailable cannot both be 0",
        ),
        (spec(rollout={"maxSurge": "a lot"}), "must be an integer or a percentage"),
        (
            {"model": {"uri": "file:///m", "tokenSecret": {"name": "s"}}},
            "tokenSecret is only used with hf:// models",
        ),
        (
            {"model": {"uri": "pvc://c/m", "cache": {"claimName": "other"}}},
            "cache.claimName cannot be set with a pvc:// model",
        ),
        (spec(drainSeconds=7200), "spec.drainSeconds: Input should be less than or equal"),
    ],
)
def test_rejects_bad_specs_with_a_readable_message(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=re.escape(message)):
        parse_spec(raw)


def test_reports_every_problem_at_once() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(spec(replicas=-1, engine={"blockSize": 0}))
    assert "spec.replicas" in str(caught.value) and "spec.engine.blockSize" in str(caught.value)


def test_a_missing_spec_is_invalid() -> None:
    with pytest.raises(InvalidSpecError, match="spec is missing"):
        parse_spec(None)


@pytest.mark.parametrize("name", ["llama", "a", "qwen-2-5", "x" * 63])
def test_accepts_dns_1035_names(name: str) -> None:
    validate_name(name)


@pytest.mark.parametrize("name", ["Llama", "1model", "llama.3", "x" * 64, "trailing-"])
def test_rejects_names_a_service_cannot_have(name: str) -> None:
    with pytest.raises(InvalidSpecError, match="DNS-1035 label"):
        validate_name(name)


def test_autoscaling_accepts_every_key_the_autoscaler_reads() -> None:
    """The CRD prunes unknown fields: every key AutoscalingPolicy.from_spec reads must be in our
    model (hence the schema), and a spec our model accepts must be one the autoscaler accepts."""
    from kvpilot.operator.autoscaling.policy import (
        SCALE_DOWN_KEYS,
        SCALE_UP_KEYS,
        TOP_LEVEL_KEYS,
        AutoscalingPolicy,
    )

    autoscaling = {key: 1 for key in TOP_LEVEL_KEYS}
    autoscaling.update(
        minReplicas=2,
        maxReplicas=5,
        targetKVCacheUtilization=0.7,
        tolerance=0.1,
        panicThreshold=2.5,
        stableWindowSeconds=60,
        panicWindowSeconds=6,
    )
    autoscaling["scaleUp"] = {key: 3 for key in SCALE_UP_KEYS}
    autoscaling["scaleDown"] = {key: 3 for key in SCALE_DOWN_KEYS}
    parsed = parse_spec(spec(autoscaling=autoscaling))
    assert parsed.autoscaling is not None
    dumped = parsed.autoscaling.model_dump(by_alias=True, exclude_none=True)
    assert dumped == autoscaling
    policy = AutoscalingPolicy.from_spec(dumped)
    assert (policy.min_replicas, policy.max_replicas) == (2, 5)


def test_autoscaling_defaults_we_document_are_the_autoscalers() -> None:
    """The descriptions (`kubectl explain`) state defaults the autoscaler applies."""
    from dataclasses import fields

    from kvpilot.operator.autoscaling.policy import SPEC_PATHS, AutoscalingPolicy
    from kvpilot.operator.autoscaling.spec import AutoscalingSpec, ScaleDown, ScaleUp

    models = {"": AutoscalingSpec, "scaleUp.": ScaleUp, "scaleDown.": ScaleDown}
    checked = 0
    for field in fields(AutoscalingPolicy):
        path = SPEC_PATHS[field.name]
        prefix, _, key = path.rpartition(".")
        model = models[f"{prefix}." if prefix else ""]
        info = next(f for n, f in model.model_fields.items() if (f.alias or n) == key)
        if field.name in ("max_replicas", "min_replicas"):
            continue  # required, or a real pydantic default (checked by the next assert)
        match = re.search(r"Default: ([0-9.e+-]+)\.", info.description or "")
        assert match, f"{path}: no 'Default: N.' in its description"
        assert float(match.group(1)) == float(field.default), path
        checked += 1
    assert checked >= 10
    assert AutoscalingSpec.model_fields["min_replicas"].default == 1


@pytest.mark.parametrize(
    "autoscaling",
    [
        {"maxReplicas": 2, "panicWindowSeconds": 20},
        {"maxReplicas": 2, "panicWindowSeconds": 25},
        {"maxReplicas": 2, "stableWindowSeconds": 60, "panicWindowSeconds": 25},
        {"maxReplicas": 2, "stableWindowSeconds": 9.5},
        {"maxReplicas": 2, "panicThreshold": 1.1},
        {"maxReplicas": 2, "panicThreshold": 1.2},
        {"maxReplicas": 2, "tolerance": 0.5},
        {"maxReplicas": 2, "tolerance": 0.5, "panicThreshold": 1.6},
        {"maxReplicas": 2, "scaleUp": {"maxRate": 1.5, "maxPodsPerStep": 1}},
    ],
)
def test_a_spec_accepted_is_one_the_autoscaler_accepts(autoscaling: dict[str, Any]) -> None:
    """No policy error is left for tick time: the model rejects exactly what the policy does."""
    from kvpilot.operator.autoscaling.policy import AutoscalingPolicy

    try:
        AutoscalingPolicy.from_spec(autoscaling)
        policy_error = None
    except ValueError as error:
        policy_error = str(error)
    try:
        parse_spec(spec(autoscaling=autoscaling))
        spec_error = None
    except InvalidSpecError as error:
        spec_error = str(error)
    assert (policy_error is None) == (spec_error is None), (policy_error, spec_error)
    if spec_error is not None:
        assert spec_error.startswith("spec.autoscaling: ")
