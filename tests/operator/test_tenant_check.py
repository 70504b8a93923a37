"""The Tenant check as a pure function: keys counted from the named Secrets' entries (each once),
what is missing, grants that match no served model, invalid specs split into one problem per
field, and only new problems posted."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract.tenant_spec import TenantSpec, parse_tenant_spec
from kvpilot.operator.tenant_check import (
    ServedIds,
    TenantCheck,
    check_tenant,
    new_problems,
    parse,
    served_ids_of,
)

SERVED = ServedIds(frozenset({"chat", "llama-3.1-8b"}), frozenset({"team-a-sql"}))


def spec(**fields: Any) -> TenantSpec:
    return parse_tenant_spec({"apiKeys": [{"name": "keys"}], **fields})


# (apiKeys, the Secrets' non-empty entries (None: missing), keys counted, problem reasons)
COUNTS = [
    ([{"name": "keys"}], {"keys": frozenset({"a", "b"})}, 2, []),
    ([{"name": "keys"}], {"keys": None}, 0, ["SecretNotFound"]),
    ([{"name": "keys"}], {"keys": frozenset()}, 0, ["KeyNotFound"]),
    ([{"name": "keys", "key": "a"}], {"keys": frozenset({"a", "b"})}, 1, []),
    ([{"name": "keys", "key": "c"}], {"keys": frozenset({"a"})}, 0, ["KeyNotFound"]),
    # One entry named twice (wholly and by key) is one key.
    ([{"name": "keys"}, {"name": "keys", "key": "a"}], {"keys": frozenset({"a", "b"})}, 2, []),
    ([{"name": "keys"}, {"name": "more"}], {"keys": frozenset({"a"}), "more": None}, 1,
     ["SecretNotFound"]),
]  # fmt: skip


@pytest.mark.parametrize(("refs", "secrets", "keys", "reasons"), COUNTS)
def test_keys_are_counted_from_the_named_secrets(
    refs: list[dict[str, str]], secrets: dict[str, Any], keys: int, reasons: list[str]
) -> None:
    result = check_tenant(parse_tenant_spec({"apiKeys": refs}), secrets, SERVED)
    assert result.keys == keys
    assert [p.reason for p in result.problems] == reasons
    assert result.ready.status is (keys > 0)
    assert result.ready.reason == ("KeysFound" if keys else "NoApiKeys")


def test_grants_that_match_no_served_model_are_a_warning_not_an_error() -> None:
    tenant = spec(models=["chat", "gpt-*", "*"], adapters=["team-a-*", "team-b-*"])
    result = check_tenant(tenant, {"keys": frozenset({"a"})}, SERVED)
    assert result.ready.status is True
    unmatched = [p.message for p in result.problems if p.reason == "GrantMatchesNoModel"]
    assert unmatched == [
        "models grant 'gpt-*' matches no model id served by an InferenceService",
        "adapters grant 'team-b-*' matches no model id served by an InferenceService",
    ]
    assert all(message in result.ready.message for message in unmatched)


def test_without_permission_the_keys_are_not_checked_and_not_counted() -> None:
    result = check_tenant(spec(models=["chat"]), None, SERVED)
    assert (result.ready.status, result.ready.reason, result.keys) == (True, "KeysNotChecked", None)
    assert "rbac.readApiKeySecrets=true" in result.ready.message


def test_an_invalid_spec_is_one_problem_per_field() -> None:
    result = parse({"apiKeys": [{"name": "k"}], "weight": 0, "priorityClass": "gold"})
    assert isinstance(result, TenantCheck)
    assert (result.ready.status, result.ready.reason, result.keys) == (False, "InvalidSpec", None)
    assert [p.message.split(":")[0] for p in result.problems] == [
        "spec.priorityClass",
        "spec.weight",
    ]
    assert isinstance(parse(None), TenantCheck)  # no spec at all


def test_only_problems_not_in_the_previous_message_are_new() -> None:
    first = check_tenant(spec(), {"keys": None}, SERVED)
    assert [p.reason for p in new_problems(first, None)] == ["SecretNotFound"]
    assert new_problems(first, first.ready.message) == []
    again = check_tenant(spec(models=["nope"]), {"keys": None}, SERVED)
    assert [p.reason for p in new_problems(again, first.ready.message)] == ["GrantMatchesNoModel"]


@pytest.mark.parametrize(
    ("body", "models", "adapters"),
    [
        ({"metadata": {"name": "chat"}, "spec": {"model": {"uri": "x"}}}, {"chat"}, set()),
        (
            {
                "metadata": {"name": "svc"},
                "spec": {"model": {"servedName": "llama"}, "adapters": [{"name": "sql"}, 7]},
            },
            {"llama"},
            {"sql"},
        ),
        ({"metadata": {"name": "odd"}, "spec": "not an object"}, {"odd"}, set()),
    ],
)
def test_served_ids_are_read_leniently(
    body: dict[str, Any], models: set[str], adapters: set[str]
) -> None:
    ids = served_ids_of(body)
    assert (set(ids.models), set(ids.adapters)) == (models, adapters)
