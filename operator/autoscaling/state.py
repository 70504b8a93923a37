"""The autoscaler's memory between ticks, kept in InferenceService status to survive restarts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

NUM_DECISIONS_KEPT = 5


def format_time(t: float) -> str:
    """Epoch seconds -> RFC 3339 UTC with milliseconds, as Kubernetes tools display it."""
    stamp = datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def parse_time(text: str) -> float:
    """RFC 3339 (a trailing Z allowed) -> epoch seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class DecisionRecord:
    """One remembered decision: what the autoscaler chose and why."""

    time: float
    from_replicas: int
    to_replicas: int
    reason: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": format_time(self.time),
            "fromReplicas": self.from_replicas,
            "toReplicas": self.to_replicas,
            "reason": self.reason,
            "message": self.message,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecisionRecord:
        try:
            return cls(
                time=parse_time(data["time"]),
                from_replicas=int(data["fromReplicas"]),
                to_replicas=int(data["toReplicas"]),
                reason=str(data["reason"]),
                message=str(data["message"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed autoscaling decision record {data!r}: {exc}") from exc


@dataclass(frozen=True)
class AutoscalerState:
    """The windows' contents, the panic clock and the recent decisions.

    samples: (time, load) per tick with data, load being the summed saturation of all Ready pods
        (in pods-at-target); kept for the stable window.
    recommendations: (time, replicas) per tick with data; kept for the longer stabilization window.
    panic_since: last time the panic window crossed the panic threshold; None when not panicking.
    Times are epoch seconds rounded to milliseconds, so the dict round trip is exact.
    """

    samples: tuple[tuple[float, float], ...] = ()
    recommendations: tuple[tuple[float, int], ...] = ()
    panic_since: float | None = None
    last_tick: float | None = None
    last_scale_time: float | None = None
    num_missing_pods: int = 0
    decisions: tuple[DecisionRecord, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; decisions are human-readable, window contents are compact number pairs."""
        return {
            "window": {
                "samples": [[t, load] for t, load in self.samples],
                "recommendations": [[t, n] for t, n in self.recommendations],
                "panicSince": self.panic_since,
                "lastTick": self.last_tick,
                "numMissingPods": self.num_missing_pods,
            },
            "lastScaleTime": (
                None if self.last_scale_time is None else format_time(self.last_scale_time)
            ),
            "decisions": [record.to_dict() for record in self.decisions],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AutoscalerState:
        """Inverse of to_dict; None or {} is a fresh state. Raises ValueError when malformed."""
        if not data:
            return cls()
        try:
            window = data.get("window") or {}
            last_scale = data.get("lastScaleTime")
            return cls(
                samples=tuple(
                    (_finite(t), _finite(load)) for t, load in window.get("samples") or ()
                ),
                recommendations=tuple(
                    (_finite(t), int(n)) for t, n in window.get("recommendations") or ()
                ),
                panic_since=_optional(window.get("panicSince")),
                last_tick=_optional(window.get("lastTick")),
                last_scale_time=None if last_scale is None else parse_time(last_scale),
                num_missing_pods=int(window.get("numMissingPods") or 0),
                decisions=tuple(
                    DecisionRecord.from_dict(item) for item in data.get("decisions") or ()
                )[-NUM_DECISIONS_KEPT:],
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed autoscaling state in status: {exc}") from exc


def _finite(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _optional(value: Any) -> float | None:
    return None if value is None else _finite(value)
