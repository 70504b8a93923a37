"""status.conditions with apimachinery's semantics (meta.SetStatusCondition).

A condition is keyed by its type. lastTransitionTime moves only when status flips; reason,
message and observedGeneration are simply updated.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Any

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
# kstatus' abnormal-true conditions (sigs.k8s.io/cli-utils/pkg/kstatus), read by Flux, kpt and
# `kubectl wait`: Reconciling mirrors Progressing, Stalled mirrors Degraded (same reason, so they
# raise no Events of their own).
RECONCILING = "Reconciling"
STALLED = "Stalled"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED, RECONCILING, STALLED)
# Only on objects whose memory request is (or was) below the engine's need.
MEMORY_SUFFICIENT = "MemorySufficient"
# Only on objects with LoRA adapters (in the spec, or still in a replica); the adapter sync's.
ADAPTERS_READY = "AdaptersReady"
_CAMEL_CASE = re.compile(r"^[A-Z][A-Za-z0-9]*$")


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str

    def __post_init__(self) -> None:
        if not _CAMEL_CASE.fullmatch(self.reason):
            raise ValueError(f"condition reason {self.reason!r} must be CamelCase")


def with_kstatus(*conditions: Condition) -> tuple[Condition, ...]:
    """`conditions` plus kstatus' Reconciling and Stalled, derived from Progressing and Degraded."""
    by_type = {condition.type: condition for condition in conditions}
    mirrors = ((PROGRESSING, RECONCILING), (DEGRADED, STALLED))
    derived = tuple(
        Condition(kstatus, c.status, c.reason, c.message)
        for ours, kstatus in mirrors
        if (c := by_type.get(ours)) is not None
    )
    return (*conditions, *derived)


def format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]],
    new: Condition,
    *,
    generation: int | None,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Returns conditions with `new` set; the input list is left untouched."""
    status = "True" if new.status else "False"
    result = [dict(existing) for existing in conditions]
    for existing in result:
        if existing.get("type") == new.type:
            if existing.get("status") != status:
                existing["lastTransitionTime"] = format_time(now)
            existing.update(status=status, reason=new.reason, message=new.message)
            _set_generation(existing, generation)
            return result
    entry: dict[str, Any] = {
        "type": new.type,
        "status": status,
        "reason": new.reason,
        "message": new.message,
        "lastTransitionTime": format_time(now),
    }
    _set_generation(entry, generation)
    return [*result, entry]


def _set_generation(entry: dict[str, Any], generation: int | None) -> None:
    if generation is None:
        entry.pop("observedGeneration", None)
    else:
        entry["observedGeneration"] = generation


def find_condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def changed_conditions(
    old: list[dict[str, Any]], new: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Conditions of `new` whose status or reason differs from `old`: the state changes that
    deserve an Event (a message or generation update alone does not)."""
    changed = []
    for condition in new:
        before = find_condition(old, condition["type"])
        if before is None or (before.get("status"), before.get("reason")) != (
            condition["status"],
            condition["reason"],
        ):
            changed.append(condition)
    return changed
