"""The autoscaling policy: an InferenceService's spec.autoscaling, validated, frozen."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Keys of spec.autoscaling (camelCase, as in the CRD) -> policy field names.
TOP_LEVEL_KEYS = {
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "targetQueueDepth": "target_queue_depth",
    "targetKVCacheUtilization": "target_kv_cache_utilization",
    "intervalSeconds": "interval_s",
    "stableWindowSeconds": "stable_window_s",
    "panicWindowSeconds": "panic_window_s",
    "panicThreshold": "panic_threshold",
    "tolerance": "tolerance",
    "startupGraceSeconds": "startup_grace_s",
    "scaleToZeroAfterSeconds": "scale_to_zero_after_s",
}
SCALE_UP_KEYS = {
    "stabilizationWindowSeconds": "scale_up_window_s",
    "maxRate": "scale_up_max_rate",
    "maxPodsPerStep": "scale_up_max_pods",
}
SCALE_DOWN_KEYS = {
    "stabilizationWindowSeconds": "scale_down_window_s",
    "maxRate": "scale_down_max_rate",
}
INTEGER_FIELDS = {"min_replicas", "max_replicas", "scale_up_max_pods"}
# Policy field name -> its path in spec.autoscaling, for error messages.
SPEC_PATHS = {
    **{name: key for key, name in TOP_LEVEL_KEYS.items()},
    **{name: f"scaleUp.{key}" for key, name in SCALE_UP_KEYS.items()},
    **{name: f"scaleDown.{key}" for key, name in SCALE_DOWN_KEYS.items()},
}


@dataclass(frozen=True)
class AutoscalingPolicy:
    """How one InferenceService scales. Saturation 1.0 of a pod means "exactly at target".

    A pod's saturation is max(waiting / target_queue_depth, kv_usage / target_kv_cache_utilization);
    the defaults of both targets are those of the Gateway API Inference Extension's saturation
    detector (queue 5, KV cache 80 %).
    """

    max_replicas: int
    min_replicas: int = 1
    target_queue_depth: float = 5.0
    target_kv_cache_utilization: float = 0.8
    interval_s: float = 5.0
    # Metrics are averaged over the stable window for ordinary decisions, and over the short
    # panic window (two ticks) to catch bursts, as Knative's KPA does. KPA's 60 s stable window
    # made ramps wait 30-50 s (median) for a replica in bench/autoscale_sim.py; 20 s cuts that
    # to 11-14 s with no more flapping: the 300 s scale-down window is what prevents flapping.
    stable_window_s: float = 20.0
    panic_window_s: float = 10.0
    # Panic starts when the panic window's average saturation per ready pod reaches this.
    panic_threshold: float = 2.0
    tolerance: float = 0.1
    # HPA-style stabilization: scale up to the lowest, down to the highest recommendation seen
    # within the window. Scale-down waits 5 minutes because a cold start costs minutes of GPU time.
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    # One step may add max(current * (rate - 1), max_pods) pods (HPA's default: +100 % or +4),
    # and remove at most current * (1 - 1 / rate) pods.
    scale_up_max_rate: float = 2.0
    scale_up_max_pods: int = 4
    scale_down_max_rate: float = 2.0
    # A pod not Ready after this long is no longer "capacity on its way" (stuck, crash-looping).
    startup_grace_s: float = 600.0
    # minReplicas 0 only: the last replica goes after this long without load (see zero.py).
    scale_to_zero_after_s: float = 300.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value, path = getattr(self, field.name), SPEC_PATHS[field.name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"autoscaling.{path} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"autoscaling.{path} must be finite, got {value!r}")
            if field.name in INTEGER_FIELDS and value != int(value):
                raise ValueError(f"autoscaling.{path} must be an integer, got {value!r}")
        if self.min_replicas < 0:
            # 0: scale to zero; kvpilot router holds the requests and asks for a wake.
            raise ValueError(f"autoscaling.minReplicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"autoscaling.maxReplicas ({self.max_replicas}) must be >= minReplicas"
                f" ({self.min_replicas})"
            )
        if self.target_queue_depth <= 0:
            raise ValueError(
                f"autoscaling.targetQueueDepth must be > 0, got {self.target_queue_depth}"
            )
        if not 0 < self.target_kv_cache_utilization <= 1:
            raise ValueError(
                "autoscaling.targetKVCacheUtilization is a fraction in (0, 1], got"
                f" {self.target_kv_cache_utilization}"
            )
        if self.interval_s <= 0:
            raise ValueError(f"autoscaling.intervalSeconds must be > 0, got {self.interval_s}")
        if not 0 < self.panic_window_s <= self.stable_window_s:
            raise ValueError(
                f"autoscaling: need 0 < panicWindowSeconds ({self.panic_window_s}) <="
                f" stableWindowSeconds ({self.stable_window_s})"
            )
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"autoscaling.tolerance must be in [0, 1), got {self.tolerance}")
        if self.panic_threshold <= 1 + self.tolerance:
            raise ValueError(
                f"autoscaling: panicThreshold ({self.panic_threshold}) must exceed 1 + tolerance"
                f" ({1 + self.tolerance})"
            )
        for name in (
            "scale_up_window_s",
            "scale_down_window_s",
            "startup_grace_s",
            "scale_to_zero_after_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"autoscaling.{SPEC_PATHS[name]} must be >= 0, got {getattr(self, name)}"
                )
        if self.scale_up_max_rate <= 1 or self.scale_down_max_rate <= 1:
            raise ValueError(
                "autoscaling: scaleUp.maxRate and scaleDown.maxRate must be > 1, got"
                f" {self.scale_up_max_rate} and {self.scale_down_max_rate}"
            )
        if self.scale_up_max_pods < 1:
            raise ValueError(
                f"autoscaling.scaleUp.maxPodsPerStep must be >= 1, got {self.scale_up_max_pods}"
            )
        # Stored as ints so that replica arithmetic never yields floats.
        for name in INTEGER_FIELDS:
            object.__setattr__(self, name, int(getattr(self, name)))

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any]) -> AutoscalingPolicy:
        """Builds the policy from spec.autoscaling. Absent or null keys take the defaults."""
        if not isinstance(autoscaling, Mapping):
            raise ValueError(f"autoscaling must be an object, got {type(autoscaling).__name__}")
        kwargs: dict[str, Any] = {}
        _collect(autoscaling, TOP_LEVEL_KEYS, {"scaleUp", "scaleDown"}, "autoscaling", kwargs)
        for key, names in (("scaleUp", SCALE_UP_KEYS), ("scaleDown", SCALE_DOWN_KEYS)):
            nested = autoscaling.get(key)
            if nested is None:
                continue
            if not isinstance(nested, Mapping):
                raise ValueError(f"autoscaling.{key} must be an object, got {nested!r}")
            _collect(nested, names, set(), f"autoscaling.{key}", kwargs)
        if "max_replicas" not in kwargs:
            raise ValueError("autoscaling.maxReplicas is required")
        return cls(**kwargs)

    def clamp(self, replicas: int) -> int:
        """The count within [min_replicas, max_replicas]: the only place the bounds apply."""
        return min(max(replicas, self.min_replicas), self.max_replicas)

    def saturation(self, num_waiting: float, kv_cache_usage: float) -> float:
        """One pod's saturation; 1.0 is exactly at target."""
        return max(
            num_waiting / self.target_queue_depth,
            kv_cache_usage / self.target_kv_cache_utilization,
        )


def _collect(
    source: Mapping[str, Any],
    names: Mapping[str, str],
    nested: set[str],
    where: str,
    kwargs: dict[str, Any],
) -> None:
    unknown = sorted(set(source) - set(names) - nested)
    if unknown:
        known = ", ".join(sorted({*names, *nested}))
        raise ValueError(f"{where}: unknown field(s) {unknown} (known: {known})")
    for key, name in names.items():
        if source.get(key) is not None:
            kwargs[name] = source[key]
