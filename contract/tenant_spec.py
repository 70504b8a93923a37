"""The Tenant spec as pydantic models: the single source of the Tenant CRD's schema (crdgen), and
the one parser the operator (conditions) and the router (authentication, grants, quotas) use;
in the contract because both read it.

A Tenant is one team sharing the platform's models: its API keys live in Secrets of the Tenant's
namespace (named here, never copied here), it may use the model ids and adapters its grants
match, its requests are served in its priority class and, within the class, in proportion to its
weight, and its quotas bound what it may take per minute and at once.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, ValidationError, model_validator

from kvpilot.contract.kube_model import InvalidSpecError, KubeModel, format_validation_error
from kvpilot.contract.tenancy import (
    DEFAULT_PRIORITY_CLASS,
    DEFAULT_STORE_FAILURE,
    DEFAULT_WEIGHT,
    MAX_WEIGHT,
    PriorityClass,
    Quota,
    StoreFailure,
)

# Bounds the CEL rules' cost and the router's work per request (grants are matched in order).
MAX_GRANTS = 64
MAX_KEY_SECRETS = 8
MAX_MODEL_QUOTAS = 64
# A model id, an adapter name, or a shell pattern over them (`*`, `team-a-*`).
GRANT_PATTERN = r"^[A-Za-z0-9._*?/:-]{1,253}$"


class KeySecret(KubeModel):
    """A Secret in the Tenant's namespace holding API keys of this tenant."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")
    key: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="The Secret's key holding one API key. Default: every key of the Secret is "
        "an API key of this tenant (rotate by adding the new key, then removing the old).",
    )


class QuotaSpec(KubeModel):
    """Limits over one-minute windows and at once. Absent: no limit of that kind."""

    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Prompt plus completion tokens per minute: the prompt is charged when the "
        "request is admitted, the completion as it streams.",
    )
    requests_per_minute: int | None = Field(default=None, ge=1, description="Requests per minute.")
    max_concurrent: int | None = Field(
        default=None, ge=1, description="Requests in flight at once (queued ones included)."
    )

    def quota(self) -> Quota:
        return Quota(self.tokens_per_minute, self.requests_per_minute, self.max_concurrent)


class ModelQuotaSpec(QuotaSpec):
    """A quota of this tenant on one model id (a served name or an adapter), besides its total."""

    model: str = Field(
        min_length=1, max_length=253, description="The model id (as requests name it)."
    )


class TenantSpec(KubeModel):
    api_keys: list[KeySecret] = Field(
        min_length=1,
        max_length=MAX_KEY_SECRETS,
        description="Secrets holding this tenant's API keys (clients send one as "
        "`Authorization: Bearer KEY`). Changes take effect within seconds.",
    )
    models: list[str] = Field(
        default_factory=list,
        max_length=MAX_GRANTS,
        description="Model ids (served names) this tenant may use: names or shell patterns "
        "(`*` for all). Default: none.",
    )
    adapters: list[str] = Field(
        default_factory=list,
        max_length=MAX_GRANTS,
        description="LoRA adapter names this tenant may use, whatever their base model's grant: "
        "names or shell patterns. Default: none.",
    )
    priority_class: PriorityClass = Field(
        default=DEFAULT_PRIORITY_CLASS,
        description="critical, high, standard or best-effort: when a model's replicas are "
        "saturated, better classes are served first and the worst shed first; inside a replica "
        "they are admitted (and kept under KV pressure) first. Default: standard.",
    )
    weight: int = Field(
        default=DEFAULT_WEIGHT,
        ge=1,
        le=MAX_WEIGHT,
        description="This tenant's share among the tenants of its priority class when they "
        "wait for the same model (weighted fair queuing over tokens). Default: 1.",
    )
    quota: QuotaSpec = Field(
        default_factory=QuotaSpec, description="The tenant's limits over all models."
    )
    model_quotas: list[ModelQuotaSpec] = Field(
        default_factory=list,
        max_length=MAX_MODEL_QUOTAS,
        description="Limits per model id, besides the tenant's total.",
    )
    on_store_failure: StoreFailure = Field(
        default=DEFAULT_STORE_FAILURE,
        description="When the routers' shared quota store cannot be reached: `open` admits "
        "requests against each router's own count; `closed` refuses them (503). Default: open.",
    )

    @model_validator(mode="after")
    def _check(self) -> TenantSpec:
        for field, grants in (("models", self.models), ("adapters", self.adapters)):
            for grant in grants:
                if not re.fullmatch(GRANT_PATTERN, grant):
                    raise ValueError(f"{field}: {grant!r} is not a model id or a pattern over them")
        secrets = [(s.name, s.key) for s in self.api_keys]
        if len(set(secrets)) != len(secrets):
            raise ValueError("apiKeys: a Secret (and key) is named twice")
        models = [q.model for q in self.model_quotas]
        if len(set(models)) != len(models):
            raise ValueError("modelQuotas: a model is named twice")
        return self

    def model_quota(self, model: str) -> Quota | None:
        """This tenant's quota on one model id; None where it has none."""
        for item in self.model_quotas:
            if item.model == model:
                return item.quota()
        return None


def parse_tenant_spec(spec: Any) -> TenantSpec:
    """Validates a raw Tenant spec; InvalidSpecError with one readable line per problem."""
    if not isinstance(spec, dict):
        raise InvalidSpecError("spec is missing or not an object")
    try:
        return TenantSpec.model_validate(spec)
    except ValidationError as error:
        raise InvalidSpecError(format_validation_error(error)) from None
