"""spec.autoscaling: the knobs of the queue-depth and KV-cache autoscaler, as the CRD shows them.

The autoscaler (operator/autoscaling/policy.py) owns the defaults and the rules: the descriptions
quote its defaults (so `kubectl explain` shows the numbers in force), the CEL rules embed them
(so the API server checks cross-field limits when a field is left out), and validation builds
the one AutoscalingPolicy every later step reads (`AutoscalingSpec.policy`): a spec accepted here
never fails at tick time, and nothing parses or clamps the settings again.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from kvpilot.operator.autoscaling.policy import AutoscalingPolicy
from kvpilot.operator.kubetypes import KubeModel

_AUTOSCALER_DEFAULTS = {field.name: field.default for field in dataclass_fields(AutoscalingPolicy)}


def _autoscaler_default(name: str) -> str:
    return f" Default: {_AUTOSCALER_DEFAULTS[name]:g}."


def _or_default(key: str, name: str) -> str:
    """CEL: the field as a double, or the autoscaler's default where it is left out."""
    return f"(has(self.{key}) ? double(self.{key}) : {float(_AUTOSCALER_DEFAULTS[name])!r})"


# What the API server can check across fields, with the defaults filled in (AutoscalingPolicy
# enforces the same and more; tests/operator/test_crd.py checks that both agree).
CEL_RULES = [
    {
        "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
        "message": "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
    },
    {
        "rule": f"{_or_default('panicWindowSeconds', 'panic_window_s')}"
        f" <= {_or_default('stableWindowSeconds', 'stable_window_s')}",
        "message": "autoscaling.panicWindowSeconds must be <= autoscaling.stableWindowSeconds"
        f" (defaults {_AUTOSCALER_DEFAULTS['panic_window_s']:g} and"
        f" {_AUTOSCALER_DEFAULTS['stable_window_s']:g})",
    },
    {
        "rule": f"{_or_default('panicThreshold', 'panic_threshold')}"
        f" > 1.0 + {_or_default('tolerance', 'tolerance')}",
        "message": "autoscaling.panicThreshold must be > 1 + autoscaling.tolerance"
        f" (defaults {_AUTOSCALER_DEFAULTS['panic_threshold']:g} and"
        f" {_AUTOSCALER_DEFAULTS['tolerance']:g})",
    },
]


class ScaleUp(KubeModel):
    """How fast the autoscaler adds replicas."""

    stabilization_window_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Scale up to the lowest recommendation seen in this window."
        + _autoscaler_default("scale_up_window_s"),
    )
    max_rate: float | None = Field(
        default=None,
        gt=1,
        description="One step may multiply replicas by this."
        + _autoscaler_default("scale_up_max_rate"),
    )
    max_pods_per_step: int | None = Field(
        default=None,
        ge=1,
        description="...or add this many pods, whichever is more."
        + _autoscaler_default("scale_up_max_pods"),
    )


class ScaleDown(KubeModel):
    """How fast the autoscaler removes replicas."""

    stabilization_window_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Scale down to the highest recommendation seen in this window."
        + _autoscaler_default("scale_down_window_s"),
    )
    max_rate: float | None = Field(
        default=None,
        gt=1,
        description="One step may divide replicas by this."
        + _autoscaler_default("scale_down_max_rate"),
    )


class AutoscalingSpec(KubeModel):
    """Queue-depth and KV-cache driven autoscaling (exclusive with spec.replicas)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": CEL_RULES})

    min_replicas: int = Field(
        default=1,
        ge=0,
        description="Fewest replicas. 0 scales the service to zero after scaleToZeroAfterSeconds"
        " without load; kvpilot router holds requests for it meanwhile and has it woken at once.",
    )
    max_replicas: int = Field(ge=1, description="Most replicas.")
    target_queue_depth: float | None = Field(
        default=None,
        gt=0,
        description="Waiting requests per pod at target load."
        + _autoscaler_default("target_queue_depth"),
    )
    target_kv_cache_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        alias="targetKVCacheUtilization",
        description="KV-cache usage per pod at target load, a fraction."
        + _autoscaler_default("target_kv_cache_utilization"),
    )
    interval_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Seconds between two decisions; the operator's --autoscale-interval is the"
        " shortest possible." + _autoscaler_default("interval_s"),
    )
    stable_window_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Window of the averaged load." + _autoscaler_default("stable_window_s"),
    )
    panic_window_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Short window that catches bursts." + _autoscaler_default("panic_window_s"),
    )
    panic_threshold: float | None = Field(
        default=None,
        gt=1,
        description="Load per ready pod in the panic window that scales up at once."
        + _autoscaler_default("panic_threshold"),
    )
    tolerance: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="No change while load per pod is within 1 ± tolerance."
        + _autoscaler_default("tolerance"),
    )
    startup_grace_seconds: float | None = Field(
        default=None,
        ge=0,
        description="A pod not Ready after this long stops counting as coming capacity."
        + _autoscaler_default("startup_grace_s"),
    )
    scale_to_zero_after_seconds: float | None = Field(
        default=None,
        ge=0,
        description="With minReplicas 0: how long the last replica must see no load before it"
        " goes." + _autoscaler_default("scale_to_zero_after_s"),
    )
    scale_up: ScaleUp | None = Field(default=None, description=ScaleUp.__doc__)
    scale_down: ScaleDown | None = Field(default=None, description=ScaleDown.__doc__)
    _policy: AutoscalingPolicy | None = PrivateAttr(default=None)

    @property
    def policy(self) -> AutoscalingPolicy:
        """The settings, defaults filled in, validated: built once, when the spec is parsed."""
        assert self._policy is not None  # set by the validator below
        return self._policy

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})"
            )
        # The autoscaler's own checks (panic window <= stable window, panicThreshold > 1 +
        # tolerance ...), defaults filled in: a bad combination is InvalidSpec now, at reconcile,
        # and never an error the autoscaler meets at tick time.
        try:
            self._policy = AutoscalingPolicy.from_spec(
                self.model_dump(by_alias=True, exclude_none=True)
            )
        except ValueError as error:
            raise ValueError(str(error).removeprefix("autoscaling: ")) from None
        return self
