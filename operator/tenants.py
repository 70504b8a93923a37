"""The Tenant check against the cluster: read the Tenant and the Secrets it names, compute its
status (tenant_check.py, pure), write it when it changed and post an Event per new problem.

Idempotent: a second check with nothing changed writes nothing and posts nothing. A key's value
is never read past KubeApi.read_secret_entries, so none can reach a log, a status or an Event.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kvpilot.operator.conditions import READY, find_condition
from kvpilot.operator.kube import KubeApi, KubeError
from kvpilot.operator.reconcile import PostEvent
from kvpilot.operator.tenant_check import (
    SecretEntries,
    ServedIds,
    TenantCheck,
    check_tenant,
    new_problems,
    parse,
    secret_names,
)
from kvpilot.operator.tenant_status import build_tenant_status, owned_status

FORBIDDEN = 403


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class TenantChecker:
    """Checks Tenants against the Secrets of their namespace and the model ids served."""

    def __init__(
        self,
        api: KubeApi,
        post_event: PostEvent,
        *,
        clock: Callable[[], datetime.datetime] = _utcnow,
    ) -> None:
        self._api = api
        self._post_event = post_event
        self._clock = clock
        # The change handler and the timer may check one Tenant at once: one at a time, so
        # that each sees the status the other wrote (and no Event is posted twice).
        self._lock = threading.Lock()

    def check(self, namespace: str, name: str, served: ServedIds) -> TenantCheck | None:
        """Checks one Tenant as it is now (None when it is gone) against `served`, the model
        ids of the watched InferenceServices. KubeError when the API failed."""
        with self._lock:
            body = self._api.get_tenant(namespace, name)
            if body is None:
                return None
            result = self._check(body, served)
            self._write(body, result)
            return result

    def _check(self, body: Mapping[str, Any], served: ServedIds) -> TenantCheck:
        parsed = parse(body.get("spec"))
        if isinstance(parsed, TenantCheck):
            return parsed
        secrets = self._read_secrets(body["metadata"]["namespace"], secret_names(parsed))
        return check_tenant(parsed, secrets, served)

    def _read_secrets(self, namespace: str, names: list[str]) -> dict[str, SecretEntries] | None:
        """Each named Secret's entries; None when the operator may not read Secrets."""
        found: dict[str, SecretEntries] = {}
        for name in names:
            try:
                found[name] = self._api.read_secret_entries(namespace, name)
            except KubeError as error:
                if error.status == FORBIDDEN:
                    return None
                raise
        return found

    def _write(self, body: Mapping[str, Any], result: TenantCheck) -> None:
        metadata = body["metadata"]
        previous = dict(body.get("status") or {})
        status = build_tenant_status(
            previous, metadata.get("generation"), result.ready, result.keys, self._clock()
        )
        stale = "keys" in previous and status["keys"] is None
        if owned_status(previous) == owned_status(status) and not stale:
            return
        self._api.patch_tenant_status(metadata["namespace"], metadata["name"], status)
        before = find_condition(previous.get("conditions") or [], READY) or {}
        for problem in new_problems(result, before.get("message")):
            self._post_event(body, "Warning", problem.reason, problem.message)
        became_ready = result.ready.status and before.get("status") != "True"
        if became_ready:
            self._post_event(body, "Normal", result.ready.reason, result.ready.message)
