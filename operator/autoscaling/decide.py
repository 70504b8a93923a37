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
from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class _Windows:
    """The remembered windows, as this tick leaves them."""

    samples: tuple[tuple[float, float], ...]  # (time, load)
    recommendations: tuple[tuple[float, int], ...]  # (time, replicas)
    panic_since: float | None


@dataclass(frozen=True)
class _Proposal:
    """The replicas a step of the decision arrives at, why (the reason), and what it says."""

    target: int
    reason: str
    message: str

    def amended(self, target: int, reason: str, note: str) -> _Proposal:
        return _Proposal(target, reason, self.message + note)


def decide(
    policy: AutoscalingPolicy, observations: Observations, state: AutoscalerState, now: float
) -> Decision:
    """The replicas for this tick: a proposal from the load (or its absence), held while pods
    start or fail to report, rate-limited and clamped, and the last replica's own rule."""
    now = round(now, 3)
    current = observations.current_replicas
    load, windows, proposal = _propose(policy, observations, _recent(policy, state, now), now)
    proposal = _hold_for_pods(observations, current, proposal)
    final = _last_replica(
        policy, windows, current, proposal, _limit(policy, current, proposal), now
    )
    return Decision(
        replicas=final.target,
        previous_replicas=current,
        reason=final.reason,
        message=final.message,
        is_panic=windows.panic_since is not None,
        load=load,
        state=_next_state(state, observations, windows, final, now),
        num_ready=observations.num_ready,
    )


def _recent(policy: AutoscalingPolicy, state: AutoscalerState, now: float) -> _Windows:
    """The remembered windows without what has fallen out of them: samples beyond the stable
    window, recommendations beyond the longest window that reads them."""
    history_s = max(policy.scale_up_window_s, policy.scale_down_window_s)
    if policy.min_replicas == 0:
        history_s = max(history_s, policy.scale_to_zero_after_s)
    return _Windows(
        samples=tuple(s for s in state.samples if s[0] > now - policy.stable_window_s),
        recommendations=tuple(r for r in state.recommendations if r[0] >= now - history_s),
        panic_since=state.panic_since,
    )


def _propose(
    policy: AutoscalingPolicy, observations: Observations, windows: _Windows, now: float
) -> tuple[float | None, _Windows, _Proposal]:
    """(this tick's load, the windows with it, the replicas it asks for)."""
    held = observations.num_held
    held_note = f" (with {held:g} requests held at the routers)" if held else ""
    if observations.reporting:
        return _from_load(policy, observations, windows, now, held_note)
    if observations.current_replicas == 0 and held:
        return _from_zero(policy, held, windows, now)
    return None, windows, _no_metrics(observations, held_note)


def _from_zero(
    policy: AutoscalingPolicy, held: float, windows: _Windows, now: float
) -> tuple[float, _Windows, _Proposal]:
    """At zero nothing reports: the routers' queue is the wake-up call (the same one their wake
    annotation makes at once; this one needs no annotation). No sample: once Ready, the replica
    reports the released queue itself. The recommendation keeps it up for
    scaleToZeroAfterSeconds."""
    load = round(held / policy.target_queue_depth, 4)
    windows = replace(windows, recommendations=(*windows.recommendations, (now, 1)))
    message = f"{held:g} requests held at the routers for a service at zero replicas"
    return load, windows, _Proposal(1, "ScaleFromZero", message)


def _no_metrics(observations: Observations, held_note: str) -> _Proposal:
    """No pod reported: nothing to decide on, the replicas stay."""
    num_ready = observations.num_ready
    message = (
        f"none of the {num_ready} Ready pods reported metrics"
        if num_ready
        else "no Ready pod to measure"
    )
    return _Proposal(observations.current_replicas, "NoMetrics", message + held_note)


def _measure(policy: AutoscalingPolicy, observations: Observations) -> float:
    """The summed saturation of the Ready pods (the reporting pods' mean stands in for those
    that did not report), plus the requests held at the routers: a queue no engine reports, each
    worth what a waiting request is at an engine (1 / targetQueueDepth of a pod's saturation)."""
    reporting = observations.reporting
    measured = sum(policy.saturation(m.num_waiting, m.kv_cache_usage) for m in reporting)
    held_load = observations.num_held / policy.target_queue_depth
    return round(measured * observations.num_ready / len(reporting) + held_load, 4)


def _from_load(
    policy: AutoscalingPolicy,
    observations: Observations,
    windows: _Windows,
    now: float,
    held_note: str,
) -> tuple[float, _Windows, _Proposal]:
    """The stable window's recommendation, or the panic window's while panicking."""
    current, num_ready = observations.current_replicas, observations.num_ready
    load = _measure(policy, observations)
    samples = (*windows.samples, (now, load))
    stable_load = _mean(load for _, load in samples)
    panic_load = _mean(load for t, load in samples if t > now - policy.panic_window_s)
    panic_saturation = panic_load / num_ready
    panic_since = _panic_since(policy, windows.panic_since, panic_saturation, now)
    stable_saturation = stable_load / num_ready
    is_within_tolerance = abs(stable_saturation - 1) <= policy.tolerance
    recent_need = math.ceil(panic_load - EPSILON)
    if panic_since is not None:
        wanted = max(recent_need, current)
    else:
        wanted = current if is_within_tolerance else math.ceil(stable_load - EPSILON)
    windows = _Windows(samples, (*windows.recommendations, (now, wanted)), panic_since)
    if panic_since is not None:
        proposal = _panic(policy, current, wanted, panic_saturation)
    else:
        proposal = _steady(policy, windows, current, recent_need, is_within_tolerance, now)
    summary = (
        f"load {load:.2f} over {len(observations.reporting)}/{num_ready} reporting Ready pods"
        f"{held_note}; {policy.stable_window_s:g}s mean saturation {stable_saturation:.2f}"
    )
    return load, windows, replace(proposal, message=f"{summary}; {proposal.message}")


def _steady(
    policy: AutoscalingPolicy,
    windows: _Windows,
    current: int,
    recent_need: int,
    is_within_tolerance: bool,
    now: float,
) -> _Proposal:
    """Outside panic: the behavior windows' verdict, which the last ticks' need must agree with."""
    proposal = _stabilize(policy, windows.recommendations, current, now)
    if proposal.reason == "Steady" and is_within_tolerance:
        proposal = replace(proposal, reason="WithinTolerance")
    return _agree_with_recent(policy, current, recent_need, proposal)


def _panic_since(
    policy: AutoscalingPolicy, since: float | None, panic_saturation: float, now: float
) -> float | None:
    """Panic starts (again) whenever the panic window's saturation reaches the threshold, and
    ends once a stable window has passed without that."""
    if panic_saturation >= policy.panic_threshold:
        return now
    if since is not None and now - since >= policy.stable_window_s:
        return None
    return since


def _panic(
    policy: AutoscalingPolicy, current: int, wanted: int, panic_saturation: float
) -> _Proposal:
    """In panic the panic window alone decides: up at once, never down."""
    message = (
        f"panic: {policy.panic_window_s:g}s mean saturation {panic_saturation:.2f}"
        f" (threshold {policy.panic_threshold:g}), wants {wanted}"
    )
    return _Proposal(wanted, "PanicScaleUp" if wanted > current else "Panic", message)


def _hold_for_pods(observations: Observations, current: int, proposal: _Proposal) -> _Proposal:
    """No scale-up while replicas are still starting (they are capacity on its way), no
    scale-down while a Ready pod does not report."""
    if proposal.target > current and observations.num_starting:
        note = f"; held: {observations.num_starting} replicas still starting"
        return proposal.amended(current, "WaitingForStartingPods", note)
    if proposal.target < current and observations.missing:
        note = f"; held: no scale-down while {len(observations.missing)} Ready pods do not report"
        return proposal.amended(current, "MissingMetrics", note)
    return proposal


def _last_replica(
    policy: AutoscalingPolicy,
    windows: _Windows,
    current: int,
    wanted: _Proposal,
    limited: _Proposal,
    now: float,
) -> _Proposal:
    """Whether the last replica goes (scale to zero): its own window, past the rate limit."""
    target, reason, note = last_replica(
        policy, windows.recommendations, current, wanted.target, limited.target, now
    )
    if reason is None:
        return limited
    return _Proposal(target, reason, limited.message + note)


def _next_state(
    state: AutoscalerState,
    observations: Observations,
    windows: _Windows,
    final: _Proposal,
    now: float,
) -> AutoscalerState:
    """The state to remember: the windows, and the decision when it moves the replicas or
    changes the reason."""
    current = observations.current_replicas
    decisions = state.decisions
    if final.target != current or not decisions or decisions[-1].reason != final.reason:
        record = DecisionRecord(now, current, final.target, final.reason, final.message)
        decisions = (*decisions, record)[-NUM_DECISIONS_KEPT:]
    return AutoscalerState(
        samples=windows.samples,
        recommendations=windows.recommendations,
        panic_since=windows.panic_since,
        last_tick=now,
        last_scale_time=now if final.target != current else state.last_scale_time,
        num_missing_pods=len(observations.missing),
        decisions=decisions,
    )


def _agree_with_recent(
    policy: AutoscalingPolicy, current: int, recent_need: int, proposal: _Proposal
) -> _Proposal:
    """The stable mean lags: never scale down below what the last ticks need (it would be called
    back a tick later), nor up beyond it (the load the older samples saw has already gone)."""
    target = proposal.target
    if target < current and recent_need > target:
        target = min(recent_need, current)
        reason = "ScaleDown" if target < current else "ScaleDownStabilizing"
        note = f"; the last {policy.panic_window_s:g}s need {recent_need}"
        return proposal.amended(target, reason, note)
    if target > current and recent_need < target:
        target = max(recent_need, current)
        reason = "ScaleUp" if target > current else "ScaleUpStabilizing"
        note = f"; the last {policy.panic_window_s:g}s need only {recent_need}"
        return proposal.amended(target, reason, note)
    return proposal


def _limit(policy: AutoscalingPolicy, current: int, proposal: _Proposal) -> _Proposal:
    """The rate limit per step, then the [min, max] clamp (which may exceed the rate limit)."""
    target, reason, message = proposal.target, proposal.reason, proposal.message
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
    return _Proposal(clamped, reason, message)


def _stabilize(
    policy: AutoscalingPolicy,
    recommendations: tuple[tuple[float, int], ...],
    current: int,
    now: float,
) -> _Proposal:
    """HPA's behavior windows: every recommendation of the window must agree before acting."""
    wanted = recommendations[-1][1]
    up_floor = min(n for t, n in recommendations if t >= now - policy.scale_up_window_s)
    down_ceiling = max(n for t, n in recommendations if t >= now - policy.scale_down_window_s)
    # The window is covered when the history reaches back to its start (one tick of slack):
    # right after a restart or an outage, a single fresh recommendation must not scale down.
    oldest = recommendations[0][0]
    is_down_covered = oldest <= now - policy.scale_down_window_s + 1.5 * policy.interval_s
    if up_floor > current:
        return _Proposal(up_floor, "ScaleUp", f"wants {wanted}, scaling up to {up_floor}")
    if wanted > current:
        return _Proposal(
            current,
            "ScaleUpStabilizing",
            f"wants {wanted}, but the {policy.scale_up_window_s:g}s scale-up window holds"
            f" {current}",
        )
    if down_ceiling < current and is_down_covered:
        return _Proposal(
            down_ceiling, "ScaleDown", f"wants {wanted}, scaling down to {down_ceiling}"
        )
    if wanted < current:
        return _Proposal(
            current,
            "ScaleDownStabilizing",
            f"wants {wanted}, but the {policy.scale_down_window_s:g}s scale-down window holds"
            f" {current}",
        )
    return _Proposal(current, "Steady", f"wants {wanted}")


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items)
