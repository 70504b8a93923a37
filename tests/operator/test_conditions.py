from __future__ import annotations

import datetime

import pytest

from kvpilot.operator.conditions import (
    Condition,
    changed_conditions,
    set_condition,
    with_kstatus,
)

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
T1 = T0 + datetime.timedelta(minutes=5)


def test_new_condition_gets_transition_time_and_generation() -> None:
    conditions = set_condition(
        [], Condition("Ready", False, "Loading", "wait"), generation=3, now=T0
    )
    assert conditions == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "Loading",
            "message": "wait",
            "lastTransitionTime": "2026-01-01T12:00:00Z",
            "observedGeneration": 3,
        }
    ]


def test_transition_time_moves_only_when_status_flips() -> None:
    first = set_condition([], Condition("Ready", False, "Loading", "a"), generation=1, now=T0)
    # Same status, new reason, message and generation: the time stays.
    second = set_condition(first, Condition("Ready", False, "Pulling", "b"), generation=2, now=T1)
    assert second[0]["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert (second[0]["reason"], second[0]["message"], second[0]["observedGeneration"]) == (
        "Pulling",
        "b",
        2,
    )
    # A flip moves it.
    third = set_condition(second, Condition("Ready", True, "Serving", "c"), generation=2, now=T1)
    assert third[0]["lastTransitionTime"] == "2026-01-01T12:05:00Z"
    assert first[0]["reason"] == "Loading"  # inputs are never mutated


def test_conditions_are_keyed_by_type() -> None:
    conditions = set_condition([], Condition("Ready", True, "Serving", ""), generation=1, now=T0)
    conditions = set_condition(
        conditions, Condition("Degraded", False, "AsExpected", ""), generation=1, now=T0
    )
    conditions = set_condition(
        conditions, Condition("Ready", False, "CrashLoopBackOff", ""), generation=1, now=T1
    )
    assert [c["type"] for c in conditions] == ["Ready", "Degraded"]
    assert conditions[0]["status"] == "False"


def test_reasons_must_be_camel_case() -> None:
    with pytest.raises(ValueError, match="CamelCase"):
        Condition("Ready", True, "not camel", "")


def test_changed_conditions_ignore_message_only_updates() -> None:
    old = set_condition([], Condition("Ready", False, "Loading", "1/2"), generation=1, now=T0)
    same_reason = set_condition(
        old, Condition("Ready", False, "Loading", "2/2"), generation=2, now=T1
    )
    assert changed_conditions(old, same_reason) == []
    flipped = set_condition(old, Condition("Ready", True, "Serving", ""), generation=1, now=T1)
    assert [c["reason"] for c in changed_conditions(old, flipped)] == ["Serving"]
    assert [c["type"] for c in changed_conditions([], old)] == ["Ready"]


def test_kstatus_conditions_mirror_progressing_and_degraded() -> None:
    ready = Condition("Ready", True, "Serving", "1/1 replica(s) ready")
    rollout = Condition("Progressing", False, "RolloutComplete", "1 replica(s) up to date")
    degraded = Condition("Degraded", True, "OOMKilled", "pod x was OOMKilled")
    assert with_kstatus(ready, rollout, degraded) == (
        ready,
        rollout,
        degraded,
        Condition("Reconciling", False, "RolloutComplete", "1 replica(s) up to date"),
        Condition("Stalled", True, "OOMKilled", "pod x was OOMKilled"),
    )
    assert with_kstatus(ready) == (ready,)
