"""The chart with tenancy: the routers' permissions on Tenants and the Secrets they name (only
with tenancy.enabled), the operator's on Tenants, the router's --tenancy and its quota store URL
arguments (the URL from a value or an existing Secret, through the environment), and the
dashboard's Tenants row over the routers' tenant metrics."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest

from kvpilot.contract.tenancy import TENANT_PLURAL

from ..observability.promql import metric_names
from .chart import CHART, of_kind, operator_rules, rbac_allows, render

DASHBOARD = CHART / "files" / "dashboards" / "kvpilot.json"
TENANT_METRICS = {
    "kvpilot_router_tenant_requests_total",
    "kvpilot_router_tenant_tokens_total",
    "kvpilot_router_tenant_rejections_total",
    "kvpilot_router_tenant_queued",
    "kvpilot_router_tenant_queue_seconds_bucket",
}
TENANCY_CALLS = (
    ("kvpilot.dev", TENANT_PLURAL, "get"),
    ("kvpilot.dev", TENANT_PLURAL, "list"),
    ("kvpilot.dev", TENANT_PLURAL, "watch"),
    ("kvpilot.dev", f"{TENANT_PLURAL}/status", "patch"),
    ("", "secrets", "get"),
    ("", "secrets", "list"),
    ("", "secrets", "watch"),
)


def router_rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    (role,) = of_kind(render(values, component="router"), "ClusterRole")
    return role["rules"]


def router_container(values: dict[str, Any] | None = None) -> dict[str, Any]:
    (deployment,) = of_kind(render(values, component="router"), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_the_router_may_read_tenants_and_their_secrets_only_with_tenancy() -> None:
    assert not any(rbac_allows(router_rules(), *call) for call in TENANCY_CALLS)
    rules = router_rules({"tenancy": {"enabled": True}})
    assert all(rbac_allows(rules, *call) for call in TENANCY_CALLS)
    assert not rbac_allows(rules, "kvpilot.dev", TENANT_PLURAL, "patch")  # status only
    assert not rbac_allows(rules, "", "secrets", "create")


def test_the_operator_checks_tenants_and_reads_secrets_only_when_asked() -> None:
    rules = operator_rules()
    for verb in ("get", "list", "watch", "patch"):
        assert rbac_allows(rules, "kvpilot.dev", TENANT_PLURAL, verb), verb
    assert rbac_allows(rules, "kvpilot.dev", f"{TENANT_PLURAL}/status", "patch")
    assert rbac_allows(rules, "", "events", "create")
    assert not rbac_allows(rules, "", "secrets", "get")
    assert rbac_allows(operator_rules({"rbac": {"readApiKeySecrets": True}}), "", "secrets", "get")


def test_tenancy_arguments_reach_the_router() -> None:
    assert not any(a.startswith(("--tenancy", "--quota")) for a in router_container()["args"])

    alone = router_container({"tenancy": {"enabled": True}})
    assert "--tenancy" in alone["args"]
    assert not any(a.startswith("--quota-store-url") for a in alone["args"])

    url = "redis://quota.kvpilot-system:6379/0"
    with_url = router_container({"tenancy": {"enabled": True, "redisUrl": url}})
    # The URL reaches the router in its environment only (it may carry a password).
    assert not any(a.startswith("--quota-store-url") for a in with_url["args"])
    env = {e["name"]: e for e in with_url["env"]}
    assert env["KVPILOT_QUOTA_STORE_URL"]["value"] == url

    secret = {"name": "quota-store", "key": "url"}
    from_secret = router_container({"tenancy": {"enabled": True, "redisUrlSecret": secret}})
    assert not any(a.startswith("--quota-store-url") for a in from_secret["args"])
    env = {e["name"]: e for e in from_secret["env"]}
    assert env["KVPILOT_QUOTA_STORE_URL"]["valueFrom"] == {"secretKeyRef": secret}
    assert url not in json.dumps(from_secret)


@pytest.mark.parametrize(
    "tenancy",
    [{"enabled": "yes"}, {"redisUrl": "http://not-redis"}, {"redisUrlSecret": {"name": "Bad!"}}],
)
def test_the_values_schema_refuses_bad_tenancy_values(tenancy: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="tenancy"):
        chart.validate_schema({"tenancy": tenancy})


def test_the_dashboard_has_a_tenants_row_over_the_routers_tenant_metrics() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = [p for p in panels if p["type"] == "row"]
    assert rows[-1]["title"] == "Tenants"
    below = [p for p in panels if p["gridPos"]["y"] > rows[-1]["gridPos"]["y"]]
    read = set().union(*(metric_names(t["expr"]) for p in below for t in p["targets"]))
    assert read == TENANT_METRICS
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    grouped = {t["expr"] for p in below for t in p["targets"]}
    assert all("by (tenant" in expr for expr in grouped)  # one series per tenant
