"""A quota decision as the router answers it: admitted or why not, when to retry, and OpenAI's
x-ratelimit-* headers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpilot.contract.tenancy import (
    LIMIT_REQUESTS,
    LIMIT_TOKENS,
    REMAINING_REQUESTS,
    REMAINING_TOKENS,
    RESET_REQUESTS,
    RESET_TOKENS,
    RejectReason,
    format_reset,
)
from kvpilot.router.quota.model import Lease, LimitKind, Scope, Usage, Verdict, window_left_s

# How long a request refused for concurrency or an unreachable store should wait: neither ends
# with the window, and both usually clear within a second.
SHORT_RETRY_S = 1.0

# Per window kind: which usage it counts and its three headers (limit, remaining, reset).
_HEADERS: dict[LimitKind, tuple[str, str, str]] = {
    "requests_per_minute": (LIMIT_REQUESTS, REMAINING_REQUESTS, RESET_REQUESTS),
    "tokens_per_minute": (LIMIT_TOKENS, REMAINING_TOKENS, RESET_TOKENS),
}


@dataclass(frozen=True)
class Decision:
    """Whether a request may go on. A refusal names its reason (a RejectReason), a message fit
    for the client (no key material) and the seconds to wait before retrying. `headers` are the
    OpenAI rate-limit headers of the most constraining scope of each kind, on admissions and
    refusals alike (none of a kind that no scope limits). An admission holds a `lease` (None
    when no scope has a limit) that the caller charges and settles."""

    admitted: bool
    reason: RejectReason | None = None
    message: str = ""
    retry_after_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    lease: Lease | None = None


def describe_scope(scope_key: str) -> str:
    """A scope as a client reads it: `tenant ns/name` or `tenant ns/name for model m`."""
    tenant, _, model = scope_key.partition("|")
    return f"tenant {tenant} for model {model}" if model else f"tenant {tenant}"


def rate_limit_headers(
    scopes: Sequence[Scope], usage: Sequence[Usage], now: float
) -> dict[str, str]:
    """The headers of each window kind from the scope with the least left of it."""
    reset = format_reset(window_left_s(now))
    headers: dict[str, str] = {}
    for kind, (limit_name, remaining_name, reset_name) in _HEADERS.items():
        tightest: tuple[int, int] | None = None
        for scope, used in zip(scopes, usage, strict=True):
            limit = scope.limit(kind)
            if limit is None:
                continue
            spent = used.requests if kind == "requests_per_minute" else used.tokens
            remaining = max(0, limit - spent)
            if tightest is None or remaining < tightest[1]:
                tightest = (limit, remaining)
        if tightest is not None:
            headers[limit_name] = str(tightest[0])
            headers[remaining_name] = str(tightest[1])
            headers[reset_name] = reset
    return headers


def build_decision(
    scopes: Sequence[Scope], prompt_tokens: int, verdict: Verdict, now: float, lease: Lease | None
) -> Decision:
    """The decision a store's verdict gives (`lease`: the one the admission took)."""
    headers = rate_limit_headers(scopes, verdict.usage, now)
    if verdict.refused_kind is None:
        return Decision(admitted=True, headers=headers, lease=lease)
    assert verdict.refused_scope is not None  # a refusal always names its scope
    scope = scopes[verdict.refused_scope]
    used = verdict.usage[verdict.refused_scope]
    limit = scope.limit(verdict.refused_kind)
    who = describe_scope(scope.key)
    left_s = window_left_s(now)
    reset = format_reset(left_s)
    if verdict.refused_kind == "requests_per_minute":
        message = f"{who} has used its {limit} requests per minute; the window resets in {reset}"
        retry_after_s = left_s
    elif verdict.refused_kind == "tokens_per_minute":
        assert limit is not None
        retry_after_s = left_s
        if prompt_tokens > limit:
            message = (
                f"the prompt's {prompt_tokens} tokens exceed the limit of {limit} tokens per "
                f"minute of {who}: it can never be admitted; shorten the prompt"
            )
        else:
            message = (
                f"{who} has {max(0, limit - used.tokens)} of its {limit} tokens per minute "
                f"left and the prompt needs {prompt_tokens}; the window resets in {reset}"
            )
    else:
        message = f"{who} already has {used.concurrent} of at most {limit} requests in flight"
        retry_after_s = SHORT_RETRY_S
    return Decision(
        admitted=False,
        reason=verdict.refused_kind,
        message=message,
        retry_after_s=retry_after_s,
        headers=headers,
    )


def store_unavailable() -> Decision:
    """The refusal of a tenant whose quotas fail closed while the shared store is down: no
    headers, since nobody can say what is left."""
    return Decision(
        admitted=False,
        reason="store_unavailable",
        message="the quota store is unreachable and this tenant's quotas fail closed; retry "
        "shortly",
        retry_after_s=SHORT_RETRY_S,
    )
