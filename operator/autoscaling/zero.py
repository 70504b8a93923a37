"""Scale to zero (minReplicas 0): when the last replica may go, and waking from zero.

The last replica goes only once every recommendation of the last scaleToZeroAfterSeconds asked
for none (and the history reaches back that far): an idle spell shorter than that keeps it. The
per-step rate limit never takes 1 to 0 by itself (ceil(1 / rate) = 1), so this is the one way
down to zero. Nothing at zero reports load: a request held by kvpilot router annotates the
InferenceService (WAKE_ANNOTATION), and the operator scales it to one replica at once
(Reconciler.wake), not at the next tick.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.operator.autoscaling.policy import AutoscalingPolicy


def wake_scope(body: Mapping[str, Any]) -> tuple[int | None, AutoscalingPolicy] | None:
    """(generation, policy) to scale a woken InferenceService with, or None when it cannot
    scale to zero (no autoscaling, minReplicas above 0, or an invalid spec: reconcile reports
    that)."""
    autoscaling = (body.get("spec") or {}).get("autoscaling")
    if not autoscaling:
        return None
    try:
        policy = AutoscalingPolicy.from_spec(autoscaling)
    except ValueError:
        return None
    if policy.min_replicas != 0:
        return None
    return (body.get("metadata") or {}).get("generation"), policy


def last_replica(
    policy: AutoscalingPolicy,
    recommendations: tuple[tuple[float, int], ...],
    current: int,
    wanted: int,
    limited: int,
    now: float,
) -> tuple[int, str | None, str]:
    """(replicas, reason or None when unchanged, message suffix) for a decision that `wanted`
    fewer replicas and that the rate limit and bounds left at `limited`."""
    if policy.min_replicas != 0 or current != 1 or wanted != 0 or limited != 1:
        return limited, None, ""
    window_s = policy.scale_to_zero_after_s
    recent = [n for t, n in recommendations if t >= now - window_s]
    is_covered = bool(recommendations) and (
        recommendations[0][0] <= now - window_s + 1.5 * policy.interval_s
    )
    if is_covered and recent and max(recent) == 0:
        return 0, "ScaleToZero", f"; no load for {window_s:g}s: scaling to zero"
    return 1, "ScaleToZeroWaiting", f"; scales to zero after {window_s:g}s without load"
