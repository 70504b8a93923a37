"""What the quota keeper and its stores exchange: scopes, leases, usage and a store's verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvpilot.contract.tenancy import QUOTA_WINDOW_S, Quota

# The limits a request can run into, in the order a store checks them: the window limits first
# (their refusal waits for the window's end), then concurrency.
LimitKind = Literal["requests_per_minute", "tokens_per_minute", "concurrency"]
LIMIT_KINDS: tuple[LimitKind, ...] = ("requests_per_minute", "tokens_per_minute", "concurrency")

# Where a lease was admitted: the shared store, or this router's local store alone.
LeaseHome = Literal["shared", "local"]


@dataclass(frozen=True)
class Scope:
    """One budget: a tenant's total (`namespace/tenant`) or a tenant x model (`ns/tenant|model`)."""

    key: str
    quota: Quota

    def limit(self, kind: LimitKind) -> int | None:
        if kind == "requests_per_minute":
            return self.quota.requests_per_minute
        if kind == "tokens_per_minute":
            return self.quota.tokens_per_minute
        return self.quota.max_concurrent


def tenant_scope_key(namespace: str, tenant: str) -> str:
    """The key of a tenant's total budget."""
    return f"{namespace}/{tenant}"


def model_scope_key(namespace: str, tenant: str, model: str) -> str:
    """The key of a tenant's budget for one model id."""
    return f"{namespace}/{tenant}|{model}"


@dataclass(frozen=True)
class Lease:
    """An admitted request's hold on its scopes' concurrency; charge and settle go through it."""

    id: str
    scope_keys: tuple[str, ...]
    home: LeaseHome


@dataclass(frozen=True)
class Usage:
    """A scope's use: requests and tokens in the current window, requests in flight now."""

    requests: int = 0
    tokens: int = 0
    concurrent: int = 0


@dataclass(frozen=True)
class Verdict:
    """A store's answer to an admission: the first limit it ran into (None: admitted, and every
    scope charged) and each scope's usage after the answer, in the order of the scopes."""

    refused_kind: LimitKind | None
    refused_scope: int | None
    usage: tuple[Usage, ...]


def window_index(now: float) -> int:
    """The fixed window `now` falls in."""
    return math.floor(now / QUOTA_WINDOW_S)


def window_left_s(now: float) -> float:
    """Seconds from `now` to the end of its window."""
    return (window_index(now) + 1) * QUOTA_WINDOW_S - now
