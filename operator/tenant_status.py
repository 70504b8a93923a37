"""The Tenant's status: its schema (for the CRD) and the pure function that computes the operator's
part of it from what a check of the Tenant found.

Two writers share it, each with a merge patch of only its own keys: the operator owns
`observedGeneration`, `conditions` and `keys`; the routers own `usage`, which the operator never
writes.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

from pydantic import Field

from kvpilot.operator.conditions import Condition, set_condition
from kvpilot.operator.kubetypes import KubeModel

# The status keys the operator writes (the routers write `usage`).
OWNED_KEYS = ("observedGeneration", "conditions", "keys")


class TenantCondition(KubeModel):
    """One aspect of the tenant's state, as Kubernetes conditions are."""

    type: Literal["Ready"] = Field(
        description="Ready: the spec is valid and at least one of its API keys was found (or "
        "the operator may not read Secrets, and says so); the message warns about grants that "
        "match no model."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason of the last transition.")
    message: str = Field(description="Human-readable details.")
    last_transition_time: str = Field(
        description="When status last changed.", json_schema_extra={"format": "date-time"}
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation this condition was computed from."
    )


class TenantUsage(KubeModel):
    """What the routers counted for this tenant in the current quota window (all routers
    together, as the shared quota store holds it). Written by the routers only."""

    window_start: str | None = Field(
        default=None,
        description="Start of the one-minute window the counts are of.",
        json_schema_extra={"format": "date-time"},
    )
    requests: int | None = Field(default=None, ge=0, description="Requests admitted.")
    tokens: int | None = Field(default=None, ge=0, description="Prompt plus completion tokens.")
    concurrent: int | None = Field(default=None, ge=0, description="Requests in flight now.")
    updated_at: str | None = Field(
        default=None,
        description="When a router last wrote these counts.",
        json_schema_extra={"format": "date-time"},
    )
    reported_by: str | None = Field(
        default=None, max_length=253, description="The router (pod name) that wrote them."
    )


class TenantStatus(KubeModel):
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the operator last checked."
    )
    conditions: list[TenantCondition] = Field(
        default_factory=list, description="Ready, with its reason and message."
    )
    keys: int | None = Field(
        default=None,
        ge=0,
        description="How many API keys the named Secrets hold (a count: never a key). Absent "
        "when the operator may not read Secrets.",
    )
    usage: TenantUsage | None = Field(default=None, description=TenantUsage.__doc__)


def build_tenant_status(
    previous: dict[str, Any],
    generation: int | None,
    ready: Condition,
    keys: int | None,
    now: datetime.datetime,
) -> dict[str, Any]:
    """The operator's keys of the status: `ready` set among the previous conditions (its
    transition time kept unless its status flips), and `keys` (None: remove the count)."""
    conditions = set_condition(
        previous.get("conditions") or [], ready, generation=generation, now=now
    )
    return {"observedGeneration": generation, "conditions": conditions, "keys": keys}


def owned_status(status: dict[str, Any]) -> dict[str, Any]:
    """The operator's keys of a status (None and absent are alike: merge patches drop Nones)."""
    return {key: status[key] for key in OWNED_KEYS if status.get(key) is not None}
