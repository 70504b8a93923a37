"""Sorting pods into Ready, starting, stuck and gone, from the API's pod dicts."""

from __future__ import annotations

from datetime import datetime, timezone

from kvpilot.operator.autoscaling import PodCensus, count_pods

from .autoscaling_helpers import pod_dict

NOW = 1_700_000_000.0
GRACE = 600.0


def test_census_of_every_kind_of_pod() -> None:
    pods = [
        pod_dict("ready-a", "10.0.0.1", created=NOW - 3600),
        pod_dict("ready-b", "10.0.0.2", created=NOW - 3600),
        pod_dict("loading", "10.0.0.3", is_ready=False, created=NOW - 30),
        pod_dict("pending", None, is_ready=False, created=NOW - 5, phase="Pending"),
        pod_dict("unpersisted", None, is_ready=False),  # no creationTimestamp yet
        pod_dict("crashlooping", "10.0.0.4", is_ready=False, created=NOW - 3600),
        pod_dict("terminating", "10.0.0.5", is_deleting=True, created=NOW - 3600),
        pod_dict("done", "10.0.0.6", is_ready=False, created=NOW - 3600, phase="Succeeded"),
        pod_dict("failed", "10.0.0.7", is_ready=False, created=NOW - 30, phase="Failed"),
    ]
    census = count_pods(pods, NOW, GRACE)
    assert census == PodCensus(
        ready=(("ready-a", "10.0.0.1"), ("ready-b", "10.0.0.2")),
        num_starting=3,
        num_stuck=1,
        num_gone=3,
    )


def test_a_terminating_ready_pod_is_not_scraped() -> None:
    """It is leaving: its draining queue must not count as load nor its absence as idle."""
    pod = pod_dict("old", "10.0.0.1", created=NOW - 60, is_deleting=True)
    assert count_pods([pod], NOW, GRACE).ready == ()


def test_replicas_not_created_yet_are_on_their_way() -> None:
    census = count_pods(
        [pod_dict("a", "10.0.0.1", created=NOW), pod_dict("b", None, is_ready=False, created=NOW)],
        NOW,
        GRACE,
    )
    assert census.num_on_the_way(current_replicas=5) == 1 + 3
    assert census.num_on_the_way(current_replicas=1) == 1  # scaled down: nothing more coming


def test_stuck_pods_do_not_hold_scale_up_forever() -> None:
    stuck = pod_dict("s", None, is_ready=False, created=NOW - GRACE - 1)
    census = count_pods([pod_dict("a", "10.0.0.1", created=NOW - 3600), stuck], NOW, GRACE)
    assert census.num_starting == 0 and census.num_stuck == 1
    assert census.num_on_the_way(current_replicas=2) == 0


def test_kubernetes_client_to_dict_form_is_understood() -> None:
    """`V1Pod.to_dict()` gives snake_case keys and datetimes."""
    created = datetime.fromtimestamp(NOW - 10, tz=timezone.utc)
    pods = [
        {
            "metadata": {"name": "a", "creation_timestamp": created, "deletion_timestamp": None},
            "status": {"pod_ip": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        },
        {
            "metadata": {"name": "b", "creation_timestamp": created},
            "status": {"pod_ip": None, "conditions": [{"type": "Ready", "status": "False"}]},
        },
        {
            "metadata": {"name": "c", "creation_timestamp": created, "deletion_timestamp": created},
            "status": {"pod_ip": "10.0.0.3", "conditions": None},
        },
    ]
    assert count_pods(pods, NOW, GRACE) == PodCensus((("a", "10.0.0.1"),), 1, 0, 1)
