"""The Tenant CRD, generated from TenantSpec and TenantStatus: what the API server refuses (its
schema and CEL, evaluated as tests/operator/crd_schema.py does) the operator's model refuses too,
the example validates, and the columns of `kubectl get tenants` read fields that exist."""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.contract.tenant_spec import parse_tenant_spec
from kvpilot.operator import crdgen
from kvpilot.operator.conditions import READY, Condition
from kvpilot.operator.spec import InvalidSpecError
from kvpilot.operator.tenant_status import TenantStatus, build_tenant_status

from .crd_schema import api_server_errors, crd_schema, walk_schema

ROOT = Path(__file__).resolve().parents[2]
CRD = crdgen.build_tenant_crd()
EXAMPLE = ROOT / "examples" / "tenants" / "team-a.yaml"
GOOD = {"apiKeys": [{"name": "keys"}], "models": ["chat"]}


def tenant(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": "team-a", "namespace": "serving"},
        "spec": spec,
    }


def model_refuses(spec: dict[str, Any]) -> bool:
    try:
        parse_tenant_spec(spec)
    except InvalidSpecError:
        return True
    return False


def test_the_tenant_crd_is_namespaced_with_status_and_named_from_the_contract() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "tenants.kvpilot.dev"
    assert (spec["group"], spec["scope"]) == ("kvpilot.dev", "Namespaced")
    assert spec["names"]["kind"] == "Tenant" and spec["names"]["plural"] == "tenants"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}


def test_every_field_has_a_description_and_no_default() -> None:
    for path, node in walk_schema(crd_schema(CRD)):
        assert "default" not in node, path
        if path.count(".") >= 2 and not path.endswith("metadata"):
            assert node.get("description") or "[items]" in path, path


def test_printer_columns_read_fields_of_the_schema() -> None:
    (version,) = CRD["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == [
        "Priority", "Weight", "Keys", "Ready", "Requests/min", "Tokens/min", "Reason", "Age"
    ]  # fmt: skip
    schema = crd_schema(CRD)
    for name, path in columns.items():
        if path.startswith(".metadata"):
            continue
        node = schema
        for part in re.sub(r"\[\?\(.*?\)\]", "", path).strip(".").split("."):
            node = node["properties"][part]
            node = node.get("items", node)
        assert node, name


# (name, spec, words of the API server's refusal)
BAD = [
    ("weight-zero", {**GOOD, "weight": 0}, "weight"),
    ("weight-big", {**GOOD, "weight": 1001}, "weight"),
    ("weight-string", {**GOOD, "weight": "2"}, "weight"),
    ("priority-class", {**GOOD, "priorityClass": "gold"}, "priorityClass"),
    ("no-keys", {"apiKeys": []}, "apiKeys"),
    ("keys-missing", {"models": ["chat"]}, "apiKeys"),
    ("key-twice", {"apiKeys": [{"name": "k"}, {"name": "k"}]}, "named twice"),
    ("key-twice-keyed", {"apiKeys": [{"name": "k", "key": "a"}, {"name": "k", "key": "a"}]},
     "named twice"),
    ("grant-space", {**GOOD, "models": ["my model"]}, "models"),
    ("quota-zero", {**GOOD, "quota": {"tokensPerMinute": 0}}, "tokensPerMinute"),
    ("store-failure", {**GOOD, "onStoreFailure": "maybe"}, "onStoreFailure"),
    ("unknown-field", {**GOOD, "keys": ["sk-1"]}, "keys"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "spec", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_tenants_are_refused_by_the_api_server_and_the_model(
    name: str, spec: dict[str, Any], words: str
) -> None:
    errors = api_server_errors(CRD, tenant(spec))
    assert errors and any(words in e for e in errors), errors
    assert model_refuses(spec)


GOOD_SPECS = [
    GOOD,
    {"apiKeys": [{"name": "k"}, {"name": "k", "key": "a"}, {"name": "k", "key": "b"}]},
    {**GOOD, "priorityClass": "best-effort", "weight": 1000, "adapters": ["team-a-*"]},
    {
        **GOOD,
        "modelQuotas": [{"model": "chat", "requestsPerMinute": 5}],
        "onStoreFailure": "closed",
    },
]


@pytest.mark.parametrize("spec", GOOD_SPECS)
def test_good_tenants_pass_both(spec: dict[str, Any]) -> None:
    assert api_server_errors(CRD, tenant(spec)) == []
    assert not model_refuses(spec)


def test_model_quotas_are_a_map_keyed_by_model() -> None:
    quotas = crd_schema(CRD)["properties"]["spec"]["properties"]["modelQuotas"]
    assert quotas["x-kubernetes-list-type"] == "map"
    assert quotas["x-kubernetes-list-map-keys"] == ["model"]
    assert "model" in quotas["items"]["required"]  # a list-map key must be required


def test_the_example_tenant_validates_and_its_secret_holds_its_keys() -> None:
    secret, obj = yaml.safe_load_all(EXAMPLE.read_text())
    obj["metadata"]["namespace"] = "default"
    assert api_server_errors(CRD, obj) == []
    spec = parse_tenant_spec(obj["spec"])
    assert [ref.name for ref in spec.api_keys] == [secret["metadata"]["name"]]
    assert secret["stringData"]


def test_the_status_the_operator_writes_validates_with_the_routers_usage() -> None:
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    ready = Condition(READY, True, "KeysFound", "2 API keys in Secret(s) keys")
    status = build_tenant_status({}, 3, ready, 2, now)
    status["usage"] = {
        "windowStart": "2026-01-01T00:00:00Z",
        "requests": 4,
        "tokens": 900,
        "concurrent": 1,
        "updatedAt": "2026-01-01T00:00:20Z",
        "reportedBy": "kvpilot-router-0",
    }
    TenantStatus.model_validate(status)
    assert api_server_errors(CRD, {**tenant(GOOD), "status": status}) == []
    bad = {**status, "keys": -1}
    assert api_server_errors(CRD, {**tenant(GOOD), "status": bad})
