"""What the operator says about a Tenant, as a pure function of what it could see: the spec, the
Secrets the spec names (only which of their entries hold a value: never a value), and the model
ids the watched InferenceServices serve.

Ready is True when the spec is valid and at least one API key was found, or when the operator
may not read Secrets (then the message says the keys were not checked: the routers read them
with their own permission). Each problem is one line of the Ready message and one Warning Event
(posted once: problems already in the previous message are not posted again).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.contract.tenancy import is_granted
from kvpilot.contract.tenant_spec import TenantSpec, parse_tenant_spec
from kvpilot.operator.conditions import READY, Condition
from kvpilot.operator.spec import InvalidSpecError

# The names of a Secret's entries that hold a non-empty value; None: the Secret does not exist.
SecretEntries = frozenset[str] | None

INVALID_SPEC = "InvalidSpec"
KEYS_FOUND = "KeysFound"
KEYS_NOT_CHECKED = "KeysNotChecked"
NO_API_KEYS = "NoApiKeys"
SECRET_NOT_FOUND = "SecretNotFound"
KEY_NOT_FOUND = "KeyNotFound"
GRANT_MATCHES_NO_MODEL = "GrantMatchesNoModel"
NOT_CHECKED_MESSAGE = (
    "the operator may not read Secrets, so the API keys were not checked (install the chart "
    "with rbac.readApiKeySecrets=true to have them counted)"
)


@dataclass(frozen=True)
class ServedIds:
    """The model ids requests can name in the watched namespaces: served model names and the
    names of their LoRA adapters."""

    models: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()

    @staticmethod
    def union(parts: Iterable[ServedIds]) -> ServedIds:
        models: set[str] = set()
        adapters: set[str] = set()
        for part in parts:
            models |= part.models
            adapters |= part.adapters
        return ServedIds(frozenset(models), frozenset(adapters))


def served_ids_of(body: Mapping[str, Any]) -> ServedIds:
    """The ids one InferenceService serves, read leniently (an invalid spec still names them):
    spec.model.servedName, else its name; and spec.adapters[].name."""
    spec = body.get("spec") or {}
    model = spec.get("model") if isinstance(spec, Mapping) else None
    served = model.get("servedName") if isinstance(model, Mapping) else None
    name = served if isinstance(served, str) and served else body["metadata"]["name"]
    adapters = spec.get("adapters") if isinstance(spec, Mapping) else None
    names = {
        a["name"]
        for a in (adapters if isinstance(adapters, list) else [])
        if isinstance(a, Mapping) and isinstance(a.get("name"), str)
    }
    return ServedIds(frozenset({name}), frozenset(names))


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a Tenant: a Warning Event's reason and message."""

    reason: str
    message: str


@dataclass(frozen=True)
class TenantCheck:
    ready: Condition
    # API keys found in the named Secrets; None when they could not be counted.
    keys: int | None
    problems: tuple[Problem, ...]


def secret_names(spec: TenantSpec) -> list[str]:
    """The Secrets a valid spec names, each once, in order."""
    return list(dict.fromkeys(ref.name for ref in spec.api_keys))


def parse(raw_spec: Any) -> TenantSpec | TenantCheck:
    """The spec, or the check of a spec that is invalid (one problem per field in error)."""
    try:
        return parse_tenant_spec(raw_spec)
    except InvalidSpecError as error:
        message = str(error)
        lines = re.split(r"; (?=spec\b)", message)
        problems = tuple(Problem(INVALID_SPEC, line) for line in lines)
        return TenantCheck(Condition(READY, False, INVALID_SPEC, message), None, problems)


def count_keys(spec: TenantSpec, secrets: Mapping[str, SecretEntries]) -> tuple[int, list[Problem]]:
    """API keys the named Secrets hold (each Secret entry counted once, however often named),
    and what is missing."""
    found: set[tuple[str, str]] = set()
    problems: list[Problem] = []
    for ref in spec.api_keys:
        entries = secrets.get(ref.name)
        if entries is None:
            problems.append(Problem(SECRET_NOT_FOUND, f"Secret {ref.name} not found"))
        elif ref.key is None:
            if not entries:
                problems.append(Problem(KEY_NOT_FOUND, f"Secret {ref.name} holds no key"))
            found |= {(ref.name, entry) for entry in entries}
        elif ref.key in entries:
            found.add((ref.name, ref.key))
        else:
            problems.append(
                Problem(KEY_NOT_FOUND, f"Secret {ref.name} has no (non-empty) key {ref.key!r}")
            )
    return len(found), problems


def unmatched_grants(spec: TenantSpec, served: ServedIds) -> list[Problem]:
    """Grants that match no model id served in the watched namespaces (a typo, or a model not
    deployed yet): a warning, the Tenant stays usable."""
    problems = []
    for field, grants, ids in (
        ("models", spec.models, served.models),
        ("adapters", spec.adapters, served.adapters),
    ):
        for grant in grants:
            if not any(is_granted(name, [grant]) for name in ids):
                problems.append(
                    Problem(
                        GRANT_MATCHES_NO_MODEL,
                        f"{field} grant {grant!r} matches no model id served by an "
                        "InferenceService",
                    )
                )
    return problems


def check_tenant(
    spec: TenantSpec, secrets: Mapping[str, SecretEntries] | None, served: ServedIds
) -> TenantCheck:
    """The check of a valid spec; `secrets` None: the operator may not read Secrets."""
    warnings = unmatched_grants(spec, served)
    if secrets is None:
        ready = Condition(READY, True, KEYS_NOT_CHECKED, _lines(NOT_CHECKED_MESSAGE, warnings))
        return TenantCheck(ready, None, tuple(warnings))
    keys, missing = count_keys(spec, secrets)
    problems = (*missing, *warnings)
    if keys == 0:
        head = "no API key found"
        ready = Condition(READY, False, NO_API_KEYS, _lines(head, problems))
    else:
        names = ", ".join(secret_names(spec))
        head = f"{keys} API key{'s' if keys != 1 else ''} in Secret(s) {names}"
        ready = Condition(READY, True, KEYS_FOUND, _lines(head, problems))
    return TenantCheck(ready, keys, problems)


def new_problems(check: TenantCheck, previous_message: str | None) -> list[Problem]:
    """The problems not already reported: those absent from the previous Ready message (which
    lists every problem), so that a recheck with nothing new posts no Event."""
    before = previous_message or ""
    return [problem for problem in check.problems if problem.message not in before]


def _lines(head: str, problems: Iterable[Problem]) -> str:
    return "; ".join([head, *(problem.message for problem in problems)])
