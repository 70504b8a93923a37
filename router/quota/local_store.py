"""The in-process quota store: a single router's budget, without Redis, and its fallback."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpilot.router.quota.model import LIMIT_KINDS, Scope, Usage, Verdict, window_index


@dataclass
class _Window:
    index: int
    requests: int = 0
    tokens: int = 0


@dataclass
class _ScopeState:
    window: _Window
    # lease id -> expiry (clock seconds)
    leases: dict[str, float] = field(default_factory=dict)


class LocalQuotaStore:
    """The same semantics as RedisQuotaStore, in this process's memory. Its methods are plain
    calls, so one call is atomic on the event loop as one Redis script is."""

    def __init__(self) -> None:
        self._scopes: dict[str, _ScopeState] = {}

    def _state(self, key: str, now: float) -> _ScopeState:
        index = window_index(now)
        state = self._scopes.get(key)
        if state is None:
            state = self._scopes[key] = _ScopeState(_Window(index))
        elif state.window.index != index:
            state.window = _Window(index)
        return state

    def _usage(self, state: _ScopeState, now: float) -> Usage:
        for lease_id in [i for i, expiry in state.leases.items() if expiry <= now]:
            del state.leases[lease_id]
        return Usage(state.window.requests, state.window.tokens, len(state.leases))

    def admit(
        self,
        scopes: Sequence[Scope],
        prompt_tokens: int,
        lease_id: str,
        now: float,
        lease_expiry: float,
        *,
        check: bool = True,
    ) -> Verdict:
        """Refuse if any scope would exceed a limit, else charge them all. `check=False` charges
        without checking: the keeper mirrors what the shared store admitted, so that this
        router's own view holds if the shared store goes away."""
        states = [self._state(scope.key, now) for scope in scopes]
        usage = [self._usage(state, now) for state in states]
        if check:
            for kind in LIMIT_KINDS:
                for i, (scope, used) in enumerate(zip(scopes, usage, strict=True)):
                    limit = scope.limit(kind)
                    if limit is not None and _would_exceed(kind, used, prompt_tokens, limit):
                        return Verdict(kind, i, tuple(usage))
        for state in states:
            state.window.requests += 1
            state.window.tokens += prompt_tokens
            state.leases[lease_id] = lease_expiry
        return Verdict(None, None, tuple(self._usage(state, now) for state in states))

    def finish(
        self, scope_keys: Sequence[str], lease_id: str | None, tokens: int, now: float
    ) -> None:
        """Add `tokens` (negative: a refund) to each scope's current window and drop the lease
        (None: keep it)."""
        for key in scope_keys:
            state = self._state(key, now)
            state.window.tokens += tokens
            if lease_id is not None:
                state.leases.pop(lease_id, None)

    def renew(self, leases: Iterable[tuple[Sequence[str], str]], now: float, expiry: float) -> None:
        """Move the expiry of leases still in flight to `expiry`."""
        for scope_keys, lease_id in leases:
            for key in scope_keys:
                state = self._scopes.get(key)
                if state is not None and lease_id in state.leases:
                    state.leases[lease_id] = expiry

    def usage(self, scope_key: str, now: float) -> Usage:
        return self._usage(self._state(scope_key, now), now)


def _would_exceed(kind: str, used: Usage, prompt_tokens: int, limit: int) -> bool:
    if kind == "requests_per_minute":
        return used.requests + 1 > limit
    if kind == "tokens_per_minute":
        return used.tokens + prompt_tokens > limit
    return used.concurrent + 1 > limit
