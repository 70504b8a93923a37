"""Tenancy: what the operator, the router and the engine agree on when many teams share the pool.

A tenant (a `Tenant` custom resource, kvpilot.contract.tenant_spec) is a team: its API keys (in
Secrets, never in the CR), the model ids and LoRA adapters it may use, a priority class and a
weight, and its quotas. The router authenticates every request to a tenant, checks the grant,
charges the quota, queues it fairly when the model's replicas are saturated, and forwards it
with the tenant's engine `priority` and cache salt, which the engine honours.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvpilot.contract.kube import GROUP

# The custom resource (same group and version as InferenceService: contract.kube).
TENANT_KIND = "Tenant"
TENANT_PLURAL = "tenants"
TENANT_SINGULAR = "tenant"

# Priority classes, best first, and the engine `priority` each is forwarded with: vLLM's
# convention (a lower value is served first; a request without one is 0), so a request that no
# tenant sent ranks as `standard`.
PriorityClass = Literal["critical", "high", "standard", "best-effort"]
PRIORITY_CLASSES: dict[str, int] = {"critical": -2, "high": -1, "standard": 0, "best-effort": 1}
DEFAULT_PRIORITY_CLASS: PriorityClass = "standard"
DEFAULT_WEIGHT = 1
MAX_WEIGHT = 1000

# What the router does when the shared quota store cannot be reached: admit (and count locally,
# so one router still holds the budget it can see) or refuse with 503.
StoreFailure = Literal["open", "closed"]
DEFAULT_STORE_FAILURE: StoreFailure = "open"

# Quotas count in fixed windows of this length (as Envoy's global rate limit does): a request
# and its tokens count in the window in which they were charged.
QUOTA_WINDOW_S = 60

# The request carries its key as OpenAI's clients send it.
AUTHORIZATION_HEADER = "authorization"
BEARER = "bearer "

# OpenAI's rate-limit headers, on every response to a tenant with a quota.
LIMIT_REQUESTS = "x-ratelimit-limit-requests"
LIMIT_TOKENS = "x-ratelimit-limit-tokens"
REMAINING_REQUESTS = "x-ratelimit-remaining-requests"
REMAINING_TOKENS = "x-ratelimit-remaining-tokens"
RESET_REQUESTS = "x-ratelimit-reset-requests"
RESET_TOKENS = "x-ratelimit-reset-tokens"

# Which tenant the router served a response for (its name only: never a key).
TENANT_HEADER = "x-kvpilot-tenant"

# Reasons a request is refused, as they label the router's rejection counter.
RejectReason = Literal[
    "missing_key",
    "unknown_key",
    "not_granted",
    "requests_per_minute",
    "tokens_per_minute",
    "concurrency",
    "queue_full",
    "queue_timeout",
    "store_unavailable",
]
REJECT_REASONS: tuple[str, ...] = RejectReason.__args__  # type: ignore[attr-defined]


def engine_priority(priority_class: str) -> int:
    """The engine `priority` of a class (ValueError for an unknown class)."""
    try:
        return PRIORITY_CLASSES[priority_class]
    except KeyError:
        raise ValueError(
            f"unknown priority class {priority_class!r}; one of {', '.join(PRIORITY_CLASSES)}"
        ) from None


def priority_rank(priority_class: str) -> int:
    """0 for the best class, then 1, 2, ...: the order the router serves its queues in."""
    return list(PRIORITY_CLASSES).index(priority_class)


def key_digest(key: str) -> bytes:
    """What a router keeps of an API key: its SHA-256. Keys are long random strings, so a plain
    hash cannot be reversed; lookups go by digest and the match is confirmed in constant time."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def is_granted(name: str, patterns: Iterable[str]) -> bool:
    """Whether a model id or adapter name matches one of a tenant's grants: exact names or shell
    patterns (`*`, `team-a-*`), compared case-sensitively as model ids are."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def tenant_salt(namespace: str, tenant: str, client_salt: str | None) -> str:
    """The cache salt a tenant's request is forwarded with: its blocks are shared with no other
    tenant. A salt the client set itself (vLLM's per-user isolation) stays part of it."""
    salt = f"tenant:{namespace}/{tenant}"
    return salt if client_salt is None else f"{salt}:{client_salt}"


def unsalted_blocks(shared_prefix_tokens: int, block_size: int) -> int:
    """Blocks a request shares with every tenant: the full blocks of a prefix the platform marked
    as shared (a common system prompt). The salt applies from the next block on."""
    return shared_prefix_tokens // block_size


@dataclass(frozen=True)
class Quota:
    """Limits per window (QUOTA_WINDOW_S) and at once; None: no limit of that kind."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def is_limited(self) -> bool:
        return any(
            v is not None
            for v in (self.tokens_per_minute, self.requests_per_minute, self.max_concurrent)
        )


def format_reset(seconds: float) -> str:
    """A reset time as OpenAI writes it: `20ms`, `1s`, `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


# The label a Secret may carry so that `kubectl get secrets -l` finds a tenant's keys; the
# Tenant names its Secrets itself (spec.apiKeys), the label is for people.
TENANT_LABEL = f"{GROUP}/tenant"
