"""The engines' API keys, one per InferenceService that names a Secret for it
(spec.engine.apiKeySecret): the router sends it to that service's replicas on every path it
calls (proxied requests, the block-event stream, the tokenizer files).

Each named Secret is read with a `get` (never list or watch: RBAC cannot narrow those to the
Secrets named, and the chart grants the routers `get` alone), again every refresh_s, and at once
after a replica answered 401, so a rotated key is used within seconds. An engine reads its key
once, at start: until its pod is replaced it keeps requiring the key before the rotation, so the
previous key stays a candidate, and each replica keeps the one its engine accepted
(kvpilot.router.replica.follow). A key lives in memory only: never logged, never a metric label.
A service that names no Secret gets the fallback key (--engine-api-key-file: static backends)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import Iterable

import httpx

from kvpilot.router.cluster import SecretKeyRef, ServiceInfo
from kvpilot.router.kube import secrets_path
from kvpilot.router.metrics import RouterMetrics

log = logging.getLogger("kvpilot.router")

# Rounds of reads start at least this far apart: replicas answering 401 in a burst cost one read
# of each Secret, not one per answer.
_MIN_ROUND_GAP_S = 0.5


class EngineKeys:
    def __init__(
        self,
        kube: httpx.AsyncClient | None,
        metrics: RouterMetrics,
        *,
        fallback: str | None,
        refresh_s: float,
    ) -> None:
        self.kube = kube
        self.metrics = metrics
        self.fallback = fallback
        self.refresh_s = refresh_s
        self._wanted: frozenset[SecretKeyRef] = frozenset()
        self._keys: dict[SecretKeyRef, str] = {}
        self._previous: dict[SecretKeyRef, str] = {}  # before the last rotation
        self._problems: dict[SecretKeyRef, str] = {}
        self._due = asyncio.Event()

    # ---- what the registry and the proxy call ----
    def want(self, refs: Iterable[SecretKeyRef]) -> None:
        """The Secrets the known services name (every registry sync): a new one is read now, a
        key no service names any more is forgotten."""
        wanted = frozenset(refs)
        if wanted - self._wanted:
            self._due.set()
        self._wanted = wanted
        for ref in set(self._keys) - wanted:
            del self._keys[ref]
            self._previous.pop(ref, None)
        for ref in set(self._problems) - wanted:
            del self._problems[ref]

    def candidates(self, service: ServiceInfo) -> tuple[str | None, ...]:
        """The keys `service`'s replicas may require, the Secret's current one first, then the
        one before its last rotation; (None,) while its Secret is unread or unreadable (or when
        it names none and there is no fallback)."""
        ref = service.api_key_secret
        if ref is None:
            return (self.fallback,)
        found = tuple(k for k in (self._keys.get(ref), self._previous.get(ref)) if k is not None)
        return found or (None,)

    def refused(self, service: ServiceInfo, path: str) -> None:
        """A replica of `service` answered 401 on `path` (kv-events, proxy, tokenizer): counted,
        and its Secret read again now (the key may have been rotated)."""
        self.metrics.engine_unauthorized.labels(service.model, path).inc()
        if service.api_key_secret is not None:
            self._due.set()

    # ---- the reading loop ----
    async def run(self) -> None:
        """Read every wanted Secret each refresh_s or when due; until cancelled."""
        assert self.kube is not None, "reading Secrets needs Kubernetes access"
        while True:
            started = time.monotonic()
            self._due.clear()
            for ref in sorted(self._wanted, key=lambda r: (r.namespace, r.name, r.key)):
                await self.read(ref)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._due.wait(), self.refresh_s)
            await asyncio.sleep(max(0.0, started + _MIN_ROUND_GAP_S - time.monotonic()))

    async def read(self, ref: SecretKeyRef) -> None:
        assert self.kube is not None
        where = f"Secret {ref.namespace}/{ref.name}"
        try:
            response = await self.kube.get(f"{secrets_path(ref.namespace)}/{ref.name}")
        except httpx.HTTPError as exc:  # the API server away a moment: the last key stays
            self._problem(ref, "error", f"{where} could not be read ({type(exc).__name__})")
            return
        if response.status_code == 403:
            self._drop(
                ref,
                "forbidden",
                f"the router may not read {where} (its ServiceAccount needs `get` on Secrets "
                "there: the chart's rbac.readApiKeySecrets)",
            )
            return
        if response.status_code == 404:
            self._drop(ref, "missing", f"{where} does not exist")
            return
        if response.status_code != 200:
            self._problem(ref, "error", f"{where} could not be read (HTTP {response.status_code})")
            return
        encoded = ((response.json() or {}).get("data") or {}).get(ref.key)
        if not isinstance(encoded, str):
            self._drop(ref, "missing", f"{where} has no key {ref.key!r}")
            return
        try:
            key = base64.b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            self._drop(ref, "error", f"{where} key {ref.key!r} is not base64 of UTF-8 text")
            return
        if ref not in self._wanted:  # no service names it any more (changed while reading)
            return
        before = self._keys.get(ref)
        self._keys[ref] = key
        if before is not None and before != key:
            self._previous[ref] = before
            log.info("engine API key in %s (key %r) rotated: new replicas get the new one, "
                     "running ones the key they accepted", where, ref.key)  # fmt: skip
        elif self._problems.get(ref) is not None or before is None:
            log.info("engine API key read from %s (key %r)", where, ref.key)
        self._problems.pop(ref, None)

    def _drop(self, ref: SecretKeyRef, why: str, message: str) -> None:
        self._keys.pop(ref, None)
        self._previous.pop(ref, None)
        self._problem(ref, why, message + ": its replicas get no key from the router")

    def _problem(self, ref: SecretKeyRef, why: str, message: str) -> None:
        self.metrics.engine_key_read_errors.labels(ref.namespace, ref.name, why).inc()
        if self._problems.get(ref) != message:  # once per change, not every refresh
            log.warning("%s", message)
        self._problems[ref] = message


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header carrying `key` (none for None)."""
    return {"authorization": f"Bearer {key}"} if key else {}
