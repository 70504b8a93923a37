"""The pure scaling decision: observations + remembered windows -> replicas, reason, new windows.

Per tick:
1. load = summed saturation of the Ready pods (pods that failed to report are skipped: the others'
   mean stands in for them, they are never read as idle), plus the requests kvpilot routers hold
   for the service over targetQueueDepth (a queue at the router is a queue). 1.0 is one pod
   exactly at target. At zero replicas, held requests scale to one.
2. The stable window's mean load recommends ceil(load) replicas, unless the mean saturation per
   pod is within the tolerance band around 1.0. When the short panic window's mean load reaches
   panic_threshold per Ready pod, panic mode starts: that window alone decides, scaling up at once
   and never down, until a stable window passes without crossing the threshold (Knative's KPA).
3. Outside panic, HPA-style stabilization: scale up to the lowest recommendation of the scale-up
   window, down to the highest of the scale-down window once history covers it; and both metric
   windows must agree, so a lagging stable mean never moves against the last ticks.
4. Guards: no scale-up while replicas are still starting (they are capacity on its way), no
   scale-down while a Ready pod is missing, a rate limit per step, then the [min, max] clamp.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvpilot.operator.autoscaling.observations import Observations
from kvpilot.operator.autoscaling.policy import AutoscalingPolicy
from kvpilot.operator.autoscaling.state import NUM_DECISIONS_KEPT, AutoscalerState, DecisionRecord
from kvpilot.operator.autoscaling.zero import last_replica

# ceil() of a load computed from floats must not round 3.0000000001 up to 4.
EPSILON = 1e-9


@dataclass(frozen=True)
class Decision:
    replicas: int  # what the Deployment's replicas should be now (may equal previous_replicas)
    previous_replicas: int
    reason: str  # CamelCase, as for Kubernetes Events and conditions
    message: str
    is_panic: bool
    load: float | None  # summed saturation this tick; None when no pod reported
    state: AutoscalerState
    num_ready: int = 0

    @property
    def saturation(self) -> float | None:
        """Mean saturation per Ready pod this tick."""
        if self.load is None or not self.num_ready:
            return None
        return round(self.load / self.num_ready, 4)

    @property
    def direction(self) -> str:
        if self.replicas > self.previous_replicas:
            return "up"
        if self.replicas < self.previous_replicas:
            return "down"
        return "none"


def decide(
    policy: AutoscalingPolicy, observations: Observations, state: AutoscalerState, now: float
) -> Decision:
    now = round(now, 3)
    current = observations.current_replicas
    num_ready = observations.num_ready
    reporting = observations.reporting
    history_s = max(policy.scale_up_window_s, policy.scale_down_window_s)
    if policy.min_replicas == 0:
        history_s = max(history_s, policy.scale_to_zero_after_s)
    samples = tuple(s for s in state.samples if s[0] > now - policy.stable_window_s)
    recommendations = tuple(r for r in state.recommendations if r[0] >= now - history_s)
    panic_since = state.panic_since
    load: float | None = None

    # Requests held at the routers are a queue no engine reports: each is worth what a waiting
    # request is at an engine (1 / targetQueueDepth of a pod's saturation).
    held = observations.num_held
    held_load = held / policy.target_queue_depth
    held_note = f" (with {held:g} requests held at the routers)" if held else ""
    if not reporting and current == 0 and held:
        # At zero nothing reports: the routers' queue is the wake-up call (the same one their
        # wake annotation makes at once; this one needs no annotation). No sample: once Ready,
        # the replica reports the released queue itself. The recommendation keeps it up for
        # scaleToZeroAfterSeconds.
        load = round(held_load, 4)
        target, reason = 1, "ScaleFromZero"
        message = f"{held:g} requests held at the routers for a service at zero replicas"
        recommendations = (*recommendations, (now, 1))
    elif not reporting:
        target, reason = current, "NoMetrics"
        message = (
            f"none of the {num_ready} Ready pods reported metrics"
            if num_ready
            else "no Ready pod to measure"
        )
        message += held_note
    else:
        measured = sum(policy.saturation(m.num_waiting, m.kv_cache_usage) for m in reporting)
        load = round(measured * num_ready / len(reporting) + held_load, 4)
        samples = (*samples, (now, load))
        stable_load = _mean(load for _, load in samples)
        panic_load = _mean(load for t, load in samples if t > now - policy.panic_window_s)
        if panic_load / num_ready >= policy.panic_threshold:
            panic_since = now
        elif panic_since is not None and now - panic_since >= policy.stable_window_s:
            panic_since = None

        stable_saturation = stable_load / num_ready
        is_within_tolerance = abs(stable_saturation - 1) <= policy.tolerance
        recent_need = math.ceil(panic_load - EPSILON)
        if panic_since is not None:
            wanted = max(recent_need, current)
        else:
            wanted = current if is_within_tolerance else math.ceil(stable_load - EPSILON)
        recommendations = (*recommendations, (now, wanted))

        summary = (
            f"load {load:.2f} over {len(reporting)}/{num_ready} reporting Ready pods{held_note};"
            f" {policy.stable_window_s:g}s mean saturation {stable_saturation:.2f}"
        )
        if panic_since is not None:
            target = wanted
            reason = "PanicScaleUp" if wanted > current else "Panic"
            message = (
                f"{summary}; panic: {policy.panic_window_s:g}s mean saturation"
                f" {panic_load / num_ready:.2f} (threshold {policy.panic_threshold:g}),"
                f" wants {wanted}"
            )
        else:
            target, reason, message = _stabilize(policy, recommendations, current, now)
            if reason == "Steady" and is_within_tolerance:
                reason = "WithinTolerance"
            message = f"{summary}; {message}"
            target, reason, message = _agree_with_recent(
                policy, current, recent_need, target, reason, message
            )

    if target > current and observations.num_starting:
        target, reason = current, "WaitingForStartingPods"
        message += f"; held: {observations.num_starting} replicas still starting"
    if target < current and observations.missing:
        target, reason = current, "MissingMetrics"
        message += (
            f"; held: no scale-down while {len(observations.missing)} Ready pods do not report"
        )
    wanted_target = target
    target, reason, message = _limit(policy, current, target, reason, message)
    target, zero_reason, zero_message = last_replica(
        policy, recommendations, current, wanted_target, target, now
    )
    if zero_reason is not None:
        reason, message = zero_reason, message + zero_message

    decisions = state.decisions
    if target != current or not decisions or decisions[-1].reason != reason:
        record = DecisionRecord(now, current, target, reason, message)
        decisions = (*decisions, record)[-NUM_DECISIONS_KEPT:]
    new_state = AutoscalerState(
        samples=samples,
        recommendations=recommendations,
        panic_since=panic_since,
        last_tick=now,
        last_scale_time=now if target != current else state.last_scale_time,
        num_missing_pods=len(observations.missing),
        decisions=decisions,
    )
    return Decision(
        replicas=target,
        previous_replicas=current,
        reason=reason,
        message=message,
        is_panic=panic_since is not None,
        load=load,
        state=new_state,
        num_ready=num_ready,
    )


def _agree_with_recent(
    policy: AutoscalingPolicy,
    current: int,
    recent_need: int,
    target: int,
    reason: str,
    message: str,
) -> tuple[int, str, str]:
    """The stable mean lags: never scale down below what the last ticks need (it would be called
    back a tick later), nor up beyond it (the load the older samples saw has already gone)."""
    if target < current and recent_need > target:
        target = min(recent_need, current)
        reason = "ScaleDown" if target < current else "ScaleDownStabilizing"
        message += f"; the last {policy.panic_window_s:g}s need {recent_need}"
    elif target > current and recent_need < target:
        target = max(recent_need, current)
        reason = "ScaleUp" if target > current else "ScaleUpStabilizing"
        message += f"; the last {policy.panic_window_s:g}s need only {recent_need}"
    return target, reason, message


def _limit(
    policy: AutoscalingPolicy, current: int, target: int, reason: str, message: str
) -> tuple[int, str, str]:
    """The rate limit per step, then the [min, max] clamp (which may exceed the rate limit)."""
    step_up = max(math.ceil(current * policy.scale_up_max_rate), current + policy.scale_up_max_pods)
    step_down = math.ceil(current / policy.scale_down_max_rate)
    limited = min(max(target, step_down), step_up)
    if limited != target:
        message += f"; rate limit: {target} -> {limited}"
    clamped = policy.clamp(limited)
    if clamped != limited:
        message += f"; clamped to [{policy.min_replicas}, {policy.max_replicas}]: {clamped}"
        if limited == current:  # nothing but the bounds (changed by the user) moves it
            reason = "AboveMaxReplicas" if clamped < current else "BelowMinReplicas"
    if clamped == current and target != current:  # wanted to move; a bound or the rate stopped it
        if target > current:
            reason = "AtMaxReplicas" if current >= policy.max_replicas else "RateLimited"
        else:
            reason = "AtMinReplicas" if current <= policy.min_replicas else "RateLimited"
    return clamped, reason, message


def _stabilize(
    policy: AutoscalingPolicy,
    recommendations: tuple[tuple[float, int], ...],
    current: int,
    now: float,
) -> tuple[int, str, str]:
    """HPA's behavior windows: every recommendation of the window must agree before acting."""
    wanted = recommendations[-1][1]
    up_floor = min(n for t, n in recommendations if t >= now - policy.scale_up_window_s)
    down_ceiling = max(n for t, n in recommendations if t >= now - policy.scale_down_window_s)
    # The window is covered when the history reaches back to its start (one tick of slack):
    # right after a restart or an outage, a single fresh recommendation must not scale down.
    oldest = recommendations[0][0]
    is_down_covered = oldest <= now - policy.scale_down_window_s + 1.5 * policy.interval_s
    if up_floor > current:
        return up_floor, "ScaleUp", f"wants {wanted}, scaling up to {up_floor}"
    if wanted > current:
        return (
            current,
            "ScaleUpStabilizing",
            f"wants {wanted}, but the {policy.scale_up_window_s:g}s scale-up window holds"
            f" {current}",
        )
    if down_ceiling < current and is_down_covered:
        return down_ceiling, "ScaleDown", f"wants {wanted}, scaling down to {down_ceiling}"
    if wanted < current:
        return (
            current,
            "ScaleDownStabilizing",
            f"wants {wanted}, but the {policy.scale_down_window_s:g}s scale-down window holds"
            f" {current}",
        )
    return current, "Steady", f"wants {wanted}"


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items)
