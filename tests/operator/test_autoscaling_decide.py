"""Table tests of the pure scaling decision, tick by tick at the default 5 s interval."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest

from kvpilot.operator.autoscaling import (
    AutoscalerState,
    AutoscalingPolicy,
    Observations,
    PodMetrics,
    PodSample,
    decide,
)

T0 = 1_700_000_000.0
INTERVAL = 5.0

# A pod's gauges as (num_waiting, kv_cache_usage); None: its scrape failed.
AT_TARGET = (0.0, 0.8)  # saturation 1.0 at the default targets (queue 5, KV 0.8)
IDLE = (0.0, 0.0)
BUSY = (0.0, 0.6)  # saturation 0.75
OVERLOADED = (20.0, 1.0)  # saturation 4.0: 20 waiting against a target of 5
MISSING = None


@dataclass(frozen=True)
class Tick:
    pods: tuple[tuple[float, float] | None, ...]
    expect: tuple[int, str]  # replicas after the tick, reason
    starting: int = 0


def ticks(
    count: int,
    pods: list[tuple[float, float] | None],
    expect: tuple[int, str],
    starting: int = 0,
) -> list[Tick]:
    return [Tick(tuple(pods), expect, starting)] * count


def run(
    policy: AutoscalingPolicy, replicas: int, script: list[Tick], state: AutoscalerState
) -> tuple[int, AutoscalerState, list[tuple[int, str]]]:
    """Feeds the ticks to decide(), one per interval; returns what each tick decided."""
    seen: list[tuple[int, str]] = []
    for step, tick in enumerate(script):
        now = T0 + step * INTERVAL
        pods = tuple(
            PodSample(f"pod-{i}", None if gauges is None else PodMetrics(*gauges))
            for i, gauges in enumerate(tick.pods)
        )
        decision = decide(policy, Observations(replicas, pods, tick.starting), state, now)
        seen.append((decision.replicas, decision.reason))
        state, replicas = decision.state, decision.replicas
    return replicas, state, seen


POLICY = AutoscalingPolicy(max_replicas=10)

CASES = {
    "steady load at target never moves": (
        POLICY,
        3,
        ticks(80, [AT_TARGET] * 3, (3, "WithinTolerance")),
    ),
    "burst scales up at once in panic, then waits for the starting pods": (
        POLICY,
        2,
        [
            *ticks(4, [AT_TARGET] * 2, (2, "WithinTolerance")),
            # Loads 2, 2, 2, 8 in the 20 s window: stable wants 4; the 10 s panic window holds
            # loads 2 and 8, i.e. 2.5 per Ready pod >= 2.0, and wants ceil(5) = 5.
            Tick((OVERLOADED,) * 2, (5, "PanicScaleUp")),
            # Three replicas are on their way: no repeated scale-up while they load.
            Tick((OVERLOADED,) * 2, (5, "WaitingForStartingPods"), starting=3),
            Tick((OVERLOADED,) * 2, (5, "WaitingForStartingPods"), starting=3),
            # Ready now; still overloaded: 5 pods at saturation 4 want 20, rate-limited to 10.
            Tick((OVERLOADED,) * 5, (10, "PanicScaleUp")),
        ],
    ),
    "load gone when the new pods are Ready: no scale-up on stale samples": (
        POLICY,
        2,
        [
            *ticks(4, [AT_TARGET] * 2, (2, "WithinTolerance")),
            Tick((OVERLOADED,) * 2, (5, "PanicScaleUp")),
            *ticks(3, [OVERLOADED] * 2, (5, "WaitingForStartingPods"), starting=3),
            # The 20 s mean (8, 8, 8, 0) still wants 6; the panic window decides: ceil(4) < 5.
            *ticks(3, [IDLE] * 5, (5, "Panic")),
            # Panic ends 20 s after its last trigger; the scale-down window holds then.
            *ticks(3, [IDLE] * 5, (5, "ScaleDownStabilizing")),
        ],
    ),
    "panic never scales down; the scale-down window then holds": (
        POLICY,
        2,
        [
            *ticks(4, [AT_TARGET] * 2, (2, "WithinTolerance")),
            Tick((OVERLOADED,) * 2, (5, "PanicScaleUp")),
            # The load vanishes: panic lasts a stable window (20 s) past its last trigger.
            *ticks(3, [IDLE] * 5, (5, "Panic")),
            *ticks(3, [IDLE] * 5, (5, "ScaleDownStabilizing")),
        ],
    ),
    "slow ramp adds one replica at a time, never removes one": (
        POLICY,
        2,
        [
            *ticks(4, [AT_TARGET] * 2, (2, "WithinTolerance")),
            # Per-pod saturation 1.125: the 20 s mean leaves the band once it passes 1.1.
            Tick(((0.0, 0.9),) * 2, (2, "WithinTolerance")),
            Tick(((0.0, 0.9),) * 2, (2, "WithinTolerance")),
            Tick(((0.0, 0.9),) * 2, (2, "WithinTolerance")),
            Tick(((0.0, 0.9),) * 2, (3, "ScaleUp")),  # mean 1.125 -> ceil(2.25) = 3
            # The same load over 3 pods: 0.75 each, but 2 pods would not do: it stays.
            *ticks(6, [(0.0, 0.6)] * 3, (3, "Steady")),
        ],
    ),
    "drop to zero scales down only after the 300 s window, halving at most": (
        POLICY,
        4,
        [
            *ticks(61, [AT_TARGET] * 4, (4, "WithinTolerance")),
            # Recommendations 3, 2, 1, 0, 0, ... from here; the last 4 leaves the window 300 s on.
            *ticks(60, [IDLE] * 4, (4, "ScaleDownStabilizing")),
            Tick((IDLE,) * 4, (3, "ScaleDown")),
            Tick((IDLE,) * 3, (2, "ScaleDown")),
            Tick((IDLE,) * 2, (1, "ScaleDown")),
            Tick((IDLE,), (1, "AtMinReplicas")),
        ],
    ),
    "flapping input around the target holds still": (
        POLICY,
        4,
        [
            # Saturation 0.5 and 1.5 in turns: the 20 s mean is 1.0 once it holds 4 samples.
            Tick(((0.0, 0.4),) * 4, (4, "ScaleDownStabilizing")),
            Tick(((7.5, 0.8),) * 4, (4, "WithinTolerance")),
            Tick(((0.0, 0.4),) * 4, (4, "Steady")),  # mean 0.83: still needs ceil(3.3) = 4
            *[
                Tick(((7.5 * (i % 2), 0.4 + 0.4 * (i % 2)),) * 4, (4, "WithinTolerance"))
                for i in range(1, 80)
            ],
        ],
    ),
    "missing pods are skipped, not read as idle": (
        POLICY,
        4,
        [
            *ticks(61, [AT_TARGET] * 4, (4, "WithinTolerance")),
            # Two report saturation 1.0; as idle pods they would halve the load.
            *ticks(70, [AT_TARGET, AT_TARGET, MISSING, MISSING], (4, "WithinTolerance")),
        ],
    ),
    "no scale-down while a pod is missing, even after the window": (
        POLICY,
        4,
        [
            # A fresh history covers the 300 s window after 59 ticks (one tick of slack).
            *ticks(59, [IDLE] * 4, (4, "ScaleDownStabilizing")),
            Tick((IDLE, IDLE, IDLE, MISSING), (4, "MissingMetrics")),
            Tick((IDLE,) * 4, (2, "ScaleDown")),
        ],
    ),
    "scale-up still happens while a pod is missing": (
        POLICY,
        2,
        [
            *ticks(4, [AT_TARGET] * 2, (2, "WithinTolerance")),
            Tick((OVERLOADED, MISSING), (5, "PanicScaleUp")),
        ],
    ),
    "no pod reports: hold, whatever the history": (
        POLICY,
        3,
        [*ticks(5, [MISSING] * 3, (3, "NoMetrics")), *ticks(2, [], (3, "NoMetrics"))],
    ),
    "starting pods are capacity, not load, and do not block a scale-down": (
        AutoscalingPolicy(max_replicas=10, scale_down_window_s=0),
        4,
        [
            Tick((AT_TARGET,) * 2, (4, "WithinTolerance"), starting=2),
            Tick((IDLE,) * 2, (2, "ScaleDown"), starting=2),
        ],
    ),
    "clamped to maxReplicas, then held there": (
        AutoscalingPolicy(max_replicas=6),
        4,
        [
            Tick((OVERLOADED,) * 4, (6, "PanicScaleUp")),
            Tick((OVERLOADED,) * 6, (6, "AtMaxReplicas")),
        ],
    ),
    "bounds changed by the user apply even without metrics": (
        AutoscalingPolicy(min_replicas=2, max_replicas=3),
        5,
        [Tick((MISSING,) * 5, (3, "AboveMaxReplicas")), Tick((), (3, "NoMetrics"))],
    ),
    "below minReplicas scales up even while pods start": (
        AutoscalingPolicy(min_replicas=3, max_replicas=5),
        1,
        [Tick((AT_TARGET,), (3, "BelowMinReplicas"), starting=0)],
    ),
    "rate limit: +4 pods or x2 per step up": (
        AutoscalingPolicy(max_replicas=50),
        10,
        [
            Tick(((50.0, 1.0),) * 10, (20, "PanicScaleUp")),  # wants 100
            Tick(((50.0, 1.0),) * 20, (40, "PanicScaleUp")),
        ],
    ),
    "scale-up stabilization window: every recommendation must agree": (
        AutoscalingPolicy(
            max_replicas=10, scale_up_window_s=15, stable_window_s=5, panic_window_s=5
        ),
        2,
        [
            *ticks(4, [AT_TARGET] * 2, (2, "WithinTolerance")),
            *ticks(3, [(0.0, 1.0)] * 2, (2, "ScaleUpStabilizing")),  # saturation 1.25
            Tick(((0.0, 1.0),) * 2, (3, "ScaleUp")),
        ],
    ),
    "never scale down below what the last ticks need": (
        AutoscalingPolicy(
            max_replicas=10, stable_window_s=60, scale_down_window_s=15, scale_down_max_rate=100
        ),
        8,
        [
            *ticks(2, [IDLE] * 8, (8, "ScaleDownStabilizing")),
            # Load 6: the 60 s mean (0, 0, 6) wants 2, the 10 s mean (0, 6) needs 3.
            Tick(((0.0, 0.6),) * 8, (3, "ScaleDown")),
        ],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decide_table(name: str) -> None:
    policy, replicas, script = CASES[name]
    _, _, seen = run(policy, replicas, script, AutoscalerState())
    assert seen == [tick.expect for tick in script]


def test_state_round_trip_through_json_keeps_decisions_identical() -> None:
    """An operator restart between ticks (state only in status) changes nothing."""
    script = CASES["drop to zero scales down only after the 300 s window, halving at most"][2]
    _, _, expected = run(POLICY, 4, script, AutoscalerState())

    replicas, state, seen = 4, AutoscalerState(), []
    for step, tick in enumerate(script):
        state = AutoscalerState.from_dict(json.loads(json.dumps(state.to_dict())))
        pods = tuple(PodSample(f"p{i}", PodMetrics(*g)) for i, g in enumerate(tick.pods))
        decision = decide(POLICY, Observations(replicas, pods), state, T0 + step * INTERVAL)
        assert AutoscalerState.from_dict(decision.state.to_dict()) == decision.state
        seen.append((decision.replicas, decision.reason))
        state, replicas = decision.state, decision.replicas
    assert seen == expected


def test_fresh_state_does_not_scale_down_on_its_first_ticks() -> None:
    """After a restart that lost the status (or an outage) the window must refill first."""
    decision = decide(
        AutoscalingPolicy(max_replicas=10),
        Observations(4, tuple(PodSample(f"p{i}", PodMetrics(0.0, 0.0)) for i in range(4))),
        AutoscalerState(),
        T0,
    )
    assert (decision.replicas, decision.reason) == (4, "ScaleDownStabilizing")


def test_windows_are_pruned_and_decisions_capped() -> None:
    """The status must not grow: windows keep only their span, decisions only the last 5."""
    policy = AutoscalingPolicy(max_replicas=10)
    script = [Tick((OVERLOADED if i % 40 < 20 else IDLE,) * 2, (0, "")) for i in range(400)]
    _, state, seen = run(policy, 2, script, AutoscalerState())
    assert sum(1 for a, b in itertools.pairwise(seen) if a != b) > 5  # enough to overflow
    last = T0 + 399 * INTERVAL
    assert len(state.samples) == policy.stable_window_s / INTERVAL
    assert all(t > last - policy.stable_window_s for t, _ in state.samples)
    assert len(state.recommendations) == policy.scale_down_window_s / INTERVAL + 1
    assert all(t >= last - policy.scale_down_window_s for t, _ in state.recommendations)
    assert len(state.decisions) == 5
    assert [d.time for d in state.decisions] == sorted(d.time for d in state.decisions)


def test_decision_messages_say_why() -> None:
    policy = AutoscalingPolicy(max_replicas=10)
    pods = (PodSample("a", PodMetrics(20.0, 1.0)), PodSample("b", None))
    decision = decide(policy, Observations(2, pods), AutoscalerState(), T0)
    assert decision.reason == "PanicScaleUp"
    assert "panic" in decision.message and "1/2 reporting" in decision.message
    assert decision.state.decisions[-1].reason == "PanicScaleUp"
    assert decision.state.decisions[-1].to_replicas == decision.replicas == 6
    assert decision.state.last_scale_time == T0
    assert decision.direction == "up"


# ---- requests held at the routers (a queue no engine reports) ----


def pods_at(gauges: tuple[float, float], count: int) -> tuple[PodSample, ...]:
    return tuple(PodSample(f"pod-{i}", PodMetrics(*gauges)) for i in range(count))


def test_held_requests_add_to_the_queue_and_scale_saturated_replicas_up_to_max() -> None:
    """Two pods exactly at target (load 2.0, within tolerance alone) plus 20 requests held at
    the routers (20 / targetQueueDepth 5 = 4 more pods' worth): 6 wanted, clamped to max 5."""
    policy = AutoscalingPolicy(max_replicas=5)
    alone = decide(policy, Observations(2, pods_at(AT_TARGET, 2)), AutoscalerState(), T0)
    assert (alone.replicas, alone.reason, alone.load) == (2, "WithinTolerance", 2.0)

    held = decide(
        policy, Observations(2, pods_at(AT_TARGET, 2), num_held=20), AutoscalerState(), T0
    )
    assert held.load == 6.0
    assert held.saturation == 3.0  # per Ready pod: the held queue counts against them
    # Saturation 3 per pod is panic: up at once, 6 wanted, clamped to maxReplicas.
    assert (held.replicas, held.reason) == (5, "PanicScaleUp")
    assert "20 requests held at the routers" in held.message
    assert "clamped to [1, 5]" in held.message


def test_held_requests_wake_a_service_at_zero_without_any_annotation() -> None:
    policy = AutoscalingPolicy(max_replicas=3, min_replicas=0, scale_to_zero_after_s=60.0)
    idle = decide(policy, Observations(0, ()), AutoscalerState(), T0)
    assert (idle.replicas, idle.reason) == (0, "NoMetrics")

    woken = decide(policy, Observations(0, (), num_held=3), idle.state, T0 + INTERVAL)
    assert (woken.replicas, woken.reason, woken.direction) == (1, "ScaleFromZero", "up")
    assert woken.load == 0.6 and woken.saturation is None
    assert woken.state.samples == ()  # the replica reports the released queue itself
    # The wake is a recommendation of 1: the replica is not taken away at once when idle.
    state, replicas = woken.state, woken.replicas
    for step in range(2, 6):
        decision = decide(policy, Observations(replicas, pods_at(IDLE, 1)), state, T0 + step * 5)
        state, replicas = decision.state, decision.replicas
        assert replicas == 1
    assert decision.reason in ("ScaleDownStabilizing", "ScaleToZeroWaiting")


def test_held_requests_while_the_pods_start_do_not_scale_further() -> None:
    policy = AutoscalingPolicy(max_replicas=4, min_replicas=0)
    # One replica wanted, its pod not Ready yet: nothing reports, nothing to add to.
    decision = decide(policy, Observations(1, (), 1, num_held=30), AutoscalerState(), T0)
    assert (decision.replicas, decision.reason) == (1, "NoMetrics")
    assert "30 requests held" in decision.message


def test_router_in_flight_is_reported_not_added() -> None:
    """The engines count what the routers have in flight (running or waiting) already."""
    policy = AutoscalingPolicy(max_replicas=5)
    plain = decide(policy, Observations(2, pods_at(BUSY, 2)), AutoscalerState(), T0)
    counted = decide(
        policy, Observations(2, pods_at(BUSY, 2), router_in_flight=40.0), AutoscalerState(), T0
    )
    assert counted.load == plain.load == 1.5


def test_a_negative_held_count_is_refused() -> None:
    with pytest.raises(ValueError, match="num_held"):
        Observations(1, (), num_held=-1)
