"""Sorting an InferenceService's pods into Ready, starting and gone, from Kubernetes pod dicts.

Accepts both the API's JSON (camelCase: status.podIP, metadata.deletionTimestamp) and the
`kubernetes` client's `to_dict()` form (snake_case, datetimes), so callers need no conversion.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpilot.operator.autoscaling.state import parse_time


@dataclass(frozen=True)
class PodCensus:
    ready: tuple[tuple[str, str | None], ...]  # (name, pod IP) of Ready, not terminating pods
    num_starting: int  # not Ready yet, younger than the startup grace: capacity on its way
    num_stuck: int  # not Ready for longer than the grace: neither capacity nor load
    num_gone: int  # terminating, Succeeded or Failed: ignored

    def num_on_the_way(self, current_replicas: int) -> int:
        """Starting pods, plus replicas the ReplicaSet has not created yet."""
        num_known = len(self.ready) + self.num_starting + self.num_stuck
        return self.num_starting + max(0, current_replicas - num_known)


def count_pods(pods: Iterable[Mapping[str, Any]], now: float, startup_grace_s: float) -> PodCensus:
    ready: list[tuple[str, str | None]] = []
    num_starting = num_stuck = num_gone = 0
    for pod in pods:
        metadata = pod.get("metadata") or {}
        status = pod.get("status") or {}
        phase = status.get("phase")
        if _get(metadata, "deletionTimestamp", "deletion_timestamp") or phase in (
            "Succeeded",
            "Failed",
        ):
            num_gone += 1
        elif is_pod_ready(pod):
            ready.append((str(metadata.get("name")), _get(status, "podIP", "pod_ip")))
        else:
            created = _get(metadata, "creationTimestamp", "creation_timestamp")
            # A pod without a creation time is brand new (not yet persisted): it is starting.
            age = 0.0 if created is None else now - _timestamp(created)
            if age < startup_grace_s:
                num_starting += 1
            else:
                num_stuck += 1
    return PodCensus(tuple(ready), num_starting, num_stuck, num_gone)


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _get(mapping: Mapping[str, Any], camel: str, snake: str) -> Any:
    value = mapping.get(camel)
    return mapping.get(snake) if value is None else value


def _timestamp(value: str | datetime) -> float:
    return value.timestamp() if isinstance(value, datetime) else parse_time(value)
