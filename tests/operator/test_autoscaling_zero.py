"""Scale to zero (minReplicas 0), tick by tick: the last replica goes only after
scaleToZeroAfterSeconds of no load, an idle spell shorter than that keeps it, nothing at zero
scales back up by itself (a router's wake does), and minReplicas 1 never reaches zero."""

from __future__ import annotations

import pytest

from kvpilot.operator.autoscaling import AutoscalerState, AutoscalingPolicy
from kvpilot.operator.autoscaling.zero import last_replica

from .test_autoscaling_decide import AT_TARGET, IDLE, run, ticks

ZERO = AutoscalingPolicy(
    max_replicas=2, min_replicas=0, scale_down_window_s=30.0, scale_to_zero_after_s=60.0
)


def test_the_last_replica_goes_after_the_idle_period_and_zero_stays_zero() -> None:
    script = [
        *ticks(5, [IDLE], (1, "ScaleDownStabilizing")),  # the 30 s scale-down window first
        *ticks(6, [IDLE], (1, "ScaleToZeroWaiting")),  # then the last replica waits
        # At 55 s the history covers the 60 s (the same one-tick slack as the scale-down window).
        *ticks(1, [IDLE], (0, "ScaleToZero")),
        *ticks(3, [], (0, "NoMetrics")),  # no pod, no load reported: stays at zero
    ]
    replicas, _, seen = run(ZERO, 1, script, AutoscalerState())
    assert seen == [t.expect for t in script] and replicas == 0


def test_load_within_the_idle_period_keeps_the_last_replica() -> None:
    script = [
        *ticks(10, [IDLE], (1, "")),
        *ticks(1, [AT_TARGET], (1, "")),  # load at 50 s: the idle clock starts again
        *ticks(11, [IDLE], (1, "")),  # up to 105 s: under 60 s since the load
    ]
    _, _, seen = run(ZERO, 1, script, AutoscalerState())
    assert [r for r, _ in seen] == [1] * len(script)
    assert seen[-1] == (1, "ScaleToZeroWaiting")


def test_min_replicas_one_never_reaches_zero() -> None:
    policy = AutoscalingPolicy(max_replicas=2, min_replicas=1, scale_down_window_s=30.0)
    replicas, _, seen = run(policy, 1, ticks(30, [IDLE], (1, "")), AutoscalerState())
    assert replicas == 1 and {r for r, _ in seen} == {1}


@pytest.mark.parametrize(
    ("current", "wanted", "limited", "expect"),
    [
        (1, 0, 1, 0),  # idle long enough: to zero
        (2, 0, 1, 1),  # not the last replica: the ordinary rate limit decides
        (1, 1, 1, 1),  # wants one
        (0, 0, 0, 0),  # already at zero
    ],
)
def test_last_replica_rule(current: int, wanted: int, limited: int, expect: int) -> None:
    history = tuple((float(t), 0) for t in range(0, 65, 5))
    assert last_replica(ZERO, history, current, wanted, limited, 64.0)[0] == expect


def test_min_replicas_zero_is_valid_and_negative_is_not() -> None:
    assert AutoscalingPolicy.from_spec({"maxReplicas": 1, "minReplicas": 0}).min_replicas == 0
    with pytest.raises(ValueError, match="minReplicas must be >= 0"):
        AutoscalingPolicy.from_spec({"maxReplicas": 1, "minReplicas": -1})
    with pytest.raises(ValueError, match="scaleToZeroAfterSeconds must be >= 0"):
        AutoscalingPolicy.from_spec({"maxReplicas": 1, "scaleToZeroAfterSeconds": -5})
