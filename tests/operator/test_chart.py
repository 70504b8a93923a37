"""charts/kvpilot, rendered and linted by real Helm through helm-python-sdk."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
import yaml

from kvpilot.operator import crdgen
from kvpilot.operator.config import OperatorConfig, config_from
from kvpilot.operator.kube import API_CALLS, OPTIONAL_API_CALLS

from .chart import CHART, of_kind, operator_rules, rbac_allows, render


def test_chart_lints_clean_in_strict_mode() -> None:
    report = helm.lint(CHART, strict=True, namespace="kvpilot-system")
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert problems == []


def test_default_render_is_one_recreate_replica_with_a_liveness_probe() -> None:
    docs = render()
    kinds = sorted(doc["kind"] for doc in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    (deployment,) = of_kind(docs, "Deployment")
    assert deployment["metadata"]["namespace"] == "kvpilot-system"
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["kvpilot", "operator"]
    assert container["image"] == "ghcr.io/kvpilot/kvpilot:0.1.0"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["ports"] == [
        {"name": "health", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8081, "protocol": "TCP"},
    ]
    annotations = dict(deployment["spec"]["template"]["metadata"]["annotations"])
    assert len(annotations.pop("checksum/values")) == 64  # see test_chart_values.py
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8081",
        "prometheus.io/path": "/metrics",
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    (account,) = of_kind(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    (binding,) = of_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": "kvpilot-system",
        }
    ]


def operator_config(values: dict[str, Any] | None = None) -> OperatorConfig:
    (deployment,) = of_kind(render(values), "Deployment")
    return config_from(deployment["spec"]["template"]["spec"]["containers"][0]["args"], {})


def test_rendered_arguments_parse_with_the_real_cli() -> None:
    config = operator_config()
    assert config.namespaces == ()
    assert config.engine_image == "ghcr.io/kvpilot/kvpilot:0.1.0"  # the one image
    assert config.annotation_prefix == "kvpilot.dev"
    assert config.log_level == "info"
    assert config.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    assert config.resync_seconds == 30
    assert config.api_timeout_seconds == 30
    assert config.autoscale_interval_seconds == 5
    assert config.scrape_timeout_seconds == 1
    assert config.metrics_port == 8081


def test_metrics_can_be_turned_off_or_moved() -> None:
    docs = render({"metricsPort": 0, "podAnnotations": {"team": "ml"}})
    (deployment,) = of_kind(docs, "Deployment")
    template = deployment["spec"]["template"]
    annotations = dict(template["metadata"]["annotations"])
    assert annotations.pop("checksum/values")
    assert annotations == {"team": "ml"}
    assert [p["name"] for p in template["spec"]["containers"][0]["ports"]] == ["health"]
    assert operator_config({"metricsPort": 0}).metrics_port == 0
    (deployment,) = of_kind(render({"metricsPort": 9100}), "Deployment")
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    with pytest.raises(helm.HelmRenderError, match="metricsPort and livenessPort must differ"):
        render({"metricsPort": 8080})


def test_values_reach_the_operator() -> None:
    config = operator_config(
        {
            "watchNamespaces": ["team-a", "team-b"],
            "engine": {"image": "mirror.example/kvpilot:gpu"},
            "image": {"tag": "0.2.0"},
            "logLevel": "debug",
            "logFormat": "json",
            "annotationPrefix": "ml.example.com",
            "resyncSeconds": 10,
            "apiTimeoutSeconds": 5,
            "autoscaler": {"intervalSeconds": 2, "scrapeTimeoutSeconds": 0.5},
            "adapters": {"syncIntervalSeconds": 3, "loadTimeoutSeconds": 600},
            "metricsPort": 9100,
        }
    )
    assert (config.autoscale_interval_seconds, config.scrape_timeout_seconds) == (2, 0.5)
    assert (config.adapter_sync_seconds, config.adapter_load_timeout_seconds) == (3, 600)
    assert config.metrics_port == 9100
    assert config.namespaces == ("team-a", "team-b")
    assert config.engine_image == "mirror.example/kvpilot:gpu"
    assert (config.log_level, config.log_format) == ("debug", "json")
    assert config.annotation_prefix == "ml.example.com"
    assert config.resync_seconds == 10
    assert config.api_timeout_seconds == 5


def test_watched_namespaces_get_role_bindings_instead_of_a_cluster_binding() -> None:
    docs = render({"watchNamespaces": ["team-a", "team-b"]})
    assert of_kind(docs, "ClusterRoleBinding") == []
    bindings = [b for b in of_kind(docs, "RoleBinding") if b["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    # And one Role in the release namespace: listing the router pods, whose /metrics it reads.
    (role,) = of_kind(docs, "Role")
    assert role["metadata"]["namespace"] == "kvpilot-system"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    (binding,) = [b for b in of_kind(docs, "RoleBinding") if b["roleRef"]["kind"] == "Role"]
    assert binding["metadata"]["namespace"] == "kvpilot-system"
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # Not when the release namespace is watched anyway, nor without a router.
    assert of_kind(render({"watchNamespaces": ["kvpilot-system"]}), "Role") == []
    assert of_kind(render({"watchNamespaces": ["a"], "router": {"enabled": False}}), "Role") == []


def test_values_schema_rejects_bad_values() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="logLevel"):
        chart.validate_schema({"logLevel": "loud"})
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="metricsPort"):
        chart.validate_schema({"metricsPort": -1})
    report = helm.lint(CHART, {"watchNamespaces": ["Not_A_Namespace"]}, strict=True)
    assert report["errors"], report


def test_chart_ships_the_generated_crds() -> None:
    with helm.Chart.load(CHART) as chart:
        shipped = [yaml.safe_load(crd["data"]) for crd in chart.crds]
    by_name = {crd["metadata"]["name"]: crd for crd in shipped}
    assert len(by_name) == len(shipped) == 2
    assert by_name[crdgen.CRD_NAME] == crdgen.build_crd()
    assert by_name[crdgen.TENANT_CRD_NAME] == crdgen.build_tenant_crd()


def test_cluster_role_covers_the_operators_own_calls() -> None:
    rules = operator_rules()
    missing = [call for call in API_CALLS if not rbac_allows(rules, *call)]
    assert missing == []


def test_reading_api_key_secrets_is_granted_only_when_asked() -> None:
    rules = operator_rules({"rbac": {"readApiKeySecrets": True}})
    assert all(rbac_allows(rules, *call) for call in (*API_CALLS, *OPTIONAL_API_CALLS))
    assert not rbac_allows(rules, "", "secrets", "list")  # one named Secret at a time


def test_cluster_role_grants_nothing_it_does_not_need() -> None:
    rules = operator_rules()
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
    assert not rbac_allows(rules, "", "secrets", "get")  # the kubelet reads the token Secret
    for resource in ("deployments", "services", "inferenceservices"):
        group = {"deployments": "apps", "services": ""}.get(resource, "kvpilot.dev")
        assert not rbac_allows(rules, group, resource, "delete")  # garbage collection deletes


def install_notes(values: dict[str, Any] | None) -> str:
    """What `helm install` prints (templates/NOTES.txt) for these values."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="kvpilot", namespace="kvpilot-system", is_install=True)
    return rendered["kvpilot/templates/NOTES.txt"]


def test_the_install_notes_name_the_router_endpoint_when_it_runs() -> None:
    """With the router (the default) the notes point at its Service, the endpoint the operator
    also writes into each InferenceService's status; without it, at the model's own Service."""
    (router,) = of_kind(render(component="router"), "Service")
    (operator,) = of_kind(render(), "Deployment")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    (router_url,) = [a.split("=", 1)[1] for a in args if a.startswith("--router-url=")]
    port = router["spec"]["ports"][0]["port"]
    notes = install_notes(None)
    assert router_url in notes
    assert f"port-forward svc/{router['metadata']['name']} 8080:{port}" in notes
    assert "svc/smollm2" not in notes
    alone = install_notes({"router": {"enabled": False}})
    assert "router" not in alone and "port-forward svc/smollm2 8000:8000" in alone
