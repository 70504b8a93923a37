"""Who is asking: the tenants a router knows (Tenant objects and the Secrets holding their keys,
from the Kubernetes watches or a file) and, per request, the tenant its key belongs to and whether
that tenant may use the model it names.

Keys are never kept: a Secret's entries are reduced to their SHA-256 digests as the object
arrives (contract.tenancy.key_digest), looked up by digest and confirmed with a constant-time
compare. Level-based like the registry: every change re-derives the key table from the latest
objects, so a rotated or removed key stops working at the next event.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.contract import errors
from kvpilot.contract.kube_model import InvalidSpecError
from kvpilot.contract.tenancy import (
    AUTHORIZATION_HEADER,
    BEARER,
    Quota,
    engine_priority,
    is_granted,
    key_digest,
    priority_rank,
)
from kvpilot.contract.tenant_spec import TenantSpec, parse_tenant_spec
from kvpilot.router.quota import Scope, model_scope_key, tenant_scope_key

log = logging.getLogger("kvpilot.router")

ObjectKey = tuple[str, str]  # (namespace, name)
_INDEX_BYTES = 4


# Models whose scopes a tenant keeps worked out; past it they are worked out afresh (only models
# that are served reach the quota, so this is a guard, not a limit met in practice).
_SCOPES_KEPT = 256


@dataclass(frozen=True)
class Tenant:
    """A tenant as requests meet it. What every request needs of it is worked out once, when
    the tenant (a new object per change) is made."""

    namespace: str
    name: str
    spec: TenantSpec
    # The tenant's identity in quota scopes, queues and metrics: `namespace/name`.
    key: str = field(init=False)
    rank: int = field(init=False)  # priority_rank of its class
    engine_priority: int = field(init=False)
    quota: Quota = field(init=False)
    # model id -> the quota scopes its requests are charged to.
    _scopes: dict[str, tuple[Scope, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: fields set once, here
        set_field(self, "key", tenant_scope_key(self.namespace, self.name))
        set_field(self, "rank", priority_rank(self.spec.priority_class))
        set_field(self, "engine_priority", engine_priority(self.spec.priority_class))
        set_field(self, "quota", self.spec.quota.quota())

    def scopes(self, model: str) -> tuple[Scope, ...]:
        """The quota scopes a request for `model` is charged to: the tenant's total and its
        budget on that model, those that limit anything."""
        scopes = self._scopes.get(model)
        if scopes is None:
            found = []
            if self.quota.is_limited:
                found.append(Scope(self.key, self.quota))
            per_model = self.spec.model_quota(model)
            if per_model is not None and per_model.is_limited:
                found.append(Scope(model_scope_key(self.namespace, self.name, model), per_model))
            scopes = tuple(found)
            if len(self._scopes) >= _SCOPES_KEPT:
                self._scopes.clear()
            self._scopes[model] = scopes
        return scopes


def unauthorized(message: str) -> errors.APIError:
    """401 as OpenAI answers a missing or wrong key."""
    return errors.APIError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def not_granted(model: str) -> errors.APIError:
    """403 for a model id the tenant may not use: the same answer whether or not it exists."""
    return errors.APIError(
        403,
        f"The model `{model}` does not exist or you do not have access to it.",
        type="permission_error",
        param="model",
        code="model_not_granted",
    )


def presented_key(headers: dict[str, str]) -> str | None:
    """The bearer key of a request, or None."""
    value = headers.get(AUTHORIZATION_HEADER)
    if not value or value[: len(BEARER)].lower() != BEARER:
        return None
    key = value[len(BEARER) :].strip()
    return key or None


def secret_digests(secret: dict[str, Any]) -> dict[str, bytes]:
    """A Secret's entries as key digests (by entry name); entries that are not base64 or empty
    are left out. `stringData` counts as the API server would store it."""
    digests: dict[str, bytes] = {}
    for name, value in (secret.get("data") or {}).items():
        try:
            raw = base64.b64decode(value or "", validate=True).decode("utf-8").strip()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            continue
        if raw:
            digests[name] = key_digest(raw)
    for name, value in (secret.get("stringData") or {}).items():
        if isinstance(value, str) and value.strip():
            digests[name] = key_digest(value.strip())
    return digests


def object_key(obj: dict[str, Any]) -> ObjectKey:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


class TenantDirectory:
    """Tenants and key digests, fed by list/watch callbacks (or a file), queried per request."""

    def __init__(self) -> None:
        self._tenant_objects: dict[ObjectKey, dict[str, Any]] = {}
        self._secrets: dict[ObjectKey, dict[str, bytes]] = {}
        self.tenants: dict[ObjectKey, Tenant] = {}
        self._index: dict[bytes, list[tuple[bytes, Tenant]]] = {}
        self._invalid: dict[ObjectKey, str] = {}

    # ---- feeds ----
    def tenants_listed(self, namespace: str, items: Iterable[dict[str, Any]]) -> None:
        self._tenant_objects = {
            k: v for k, v in self._tenant_objects.items() if namespace and k[0] != namespace
        }
        for obj in items:
            self._tenant_objects[object_key(obj)] = obj
        self.sync()

    def tenant_event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._tenant_objects.pop(object_key(obj), None)
        else:
            self._tenant_objects[object_key(obj)] = obj
        self.sync()

    def secrets_listed(self, namespace: str, items: Iterable[dict[str, Any]]) -> None:
        self._secrets = {k: v for k, v in self._secrets.items() if namespace and k[0] != namespace}
        for obj in items:
            self._secrets[object_key(obj)] = secret_digests(obj)
        self.sync()

    def secret_event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._secrets.pop(object_key(obj), None)
        else:
            self._secrets[object_key(obj)] = secret_digests(obj)
        self.sync()

    def replace(self, tenants: Iterable[dict[str, Any]], secrets: Iterable[dict[str, Any]]) -> None:
        """Everything at once (a tenants file reloaded)."""
        self._tenant_objects = {object_key(o): o for o in tenants}
        self._secrets = {object_key(o): secret_digests(o) for o in secrets}
        self.sync()

    # ---- derived ----
    def sync(self) -> None:
        tenants: dict[ObjectKey, Tenant] = {}
        invalid: dict[ObjectKey, str] = {}
        for key, obj in self._tenant_objects.items():
            try:
                tenants[key] = Tenant(key[0], key[1], parse_tenant_spec(obj.get("spec")))
            except InvalidSpecError as exc:
                invalid[key] = str(exc)
        for key, problem in invalid.items():
            if self._invalid.get(key) != problem:
                log.warning("tenant %s/%s is ignored: %s", *key, problem)
        self._invalid = invalid
        by_digest: dict[bytes, Tenant] = {}
        for _, tenant in sorted(tenants.items()):
            for ref in tenant.spec.api_keys:
                entries = self._secrets.get((tenant.namespace, ref.name), {})
                digests = entries.values() if ref.key is None else [entries.get(ref.key)]
                for digest in digests:
                    if digest is None:
                        continue
                    owner = by_digest.setdefault(digest, tenant)
                    if owner is not tenant:
                        # One key, two tenants: the first by name keeps it, and it is said.
                        log.warning(
                            "a key of tenant %s is also a key of tenant %s: it authenticates %s",
                            tenant.key, owner.key, owner.key,
                        )  # fmt: skip
        self.tenants = tenants
        index: dict[bytes, list[tuple[bytes, Tenant]]] = {}
        for digest, tenant in by_digest.items():
            index.setdefault(digest[:_INDEX_BYTES], []).append((digest, tenant))
        self._index = index

    # ---- per request ----
    def authenticate(self, headers: dict[str, str]) -> Tenant:
        """The tenant of the request's bearer key; 401 without a key or for an unknown one."""
        key = presented_key(headers)
        if key is None:
            raise unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY`."
            )
        digest = key_digest(key)
        # Indexed by the digest's first bytes; the whole digest is confirmed in constant time.
        for known, tenant in self._index.get(digest[:_INDEX_BYTES], ()):
            if hmac.compare_digest(known, digest):
                return tenant
        raise unauthorized("Incorrect API key provided.")


def check_grant(tenant: Tenant, model: str) -> None:
    """403 unless one of the tenant's grants matches the id at all (before the model is looked
    up, so the answer says nothing of whether it exists)."""
    if not (is_granted(model, tenant.spec.models) or is_granted(model, tenant.spec.adapters)):
        raise not_granted(model)


def is_route_granted(tenant: Tenant, model: str, *, is_adapter: bool) -> bool:
    """Whether the tenant's grants of that kind (adapters or models) match the id."""
    return is_granted(model, tenant.spec.adapters if is_adapter else tenant.spec.models)


def check_route_grant(tenant: Tenant, model: str, *, is_adapter: bool) -> None:
    """403 unless the tenant's grants of that kind (adapters or models) match the id."""
    if not is_route_granted(tenant, model, is_adapter=is_adapter):
        raise not_granted(model)
