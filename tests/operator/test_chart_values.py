"""The chart as an operator of the chart sees it: values.schema.json covers every value; every
value toggled lints clean and renders manifests valid against the Kubernetes JSON schemas
(offline, kubernetes-validate; the Prometheus Operator kinds against its published models);
`helm upgrade` with other values rolls the operator; CRs of the previous CRD read under this one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator

from kvpilot.operator import crdgen
from kvpilot.operator.builders import Owner, build_deployment, build_service
from kvpilot.operator.policies import build_network_policy, build_pod_disruption_budget
from kvpilot.operator.spec import parse_spec

from .chart import CHART, of_kind, render
from .crd_schema import api_server_errors, crd_schema, walk_schema

# The oldest Kubernetes the manifests must be valid for (unhealthyPodEvictionPolicy and
# matchLabelKeys need 1.27), and the newest the package ships schemas of.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
PREVIOUS = Path(__file__).parent / "previous_crd"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())

# Every value away from its default, one set at a time (and all monitoring at once).
TOGGLED: dict[str, dict[str, Any]] = {
    "defaults": {},
    "image": {
        "image": {"repository": "registry.example/kvpilot", "tag": "dev", "pullPolicy": "Always"}
    },
    "engine-image": {"engine": {"image": "registry.example/engine:1"}},
    "pull-secrets": {"imagePullSecrets": [{"name": "regcred"}]},
    "watch-namespaces": {"watchNamespaces": ["team-a", "team-b"]},
    "tenancy": {"tenancy": {"enabled": True, "redisUrlSecret": {"name": "quota", "key": "url"}}},
    "tenancy-url": {"tenancy": {"enabled": True, "redisUrl": "redis://quota:6379/0"}},
    "logging": {"logLevel": "debug", "logFormat": "json", "resyncSeconds": 10},
    "prefix": {"annotationPrefix": "kvpilot.example.com"},
    "autoscaler": {"autoscaler": {"intervalSeconds": 2, "scrapeTimeoutSeconds": 0.5}},
    "no-metrics": {"metricsPort": 0, "livenessPort": 9090},
    "own-service-account": {
        "serviceAccount": {"create": False, "name": "mine", "annotations": {"a": "b"}},
        "rbac": {"create": False},
    },
    "service-account-annotations": {"serviceAccount": {"annotations": {"iam/role": "x"}}},
    "pod": {
        "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}},
        "podAnnotations": {"team": "ml"},
        "podLabels": {"team": "ml"},
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "priorityClassName": "system-cluster-critical",
    },
    "argocd": {"argocd": {"healthCheck": {"enabled": True, "namespace": "gitops"}}},
    "monitoring": {
        "monitoring": {
            "podMonitor": {
                "enabled": True,
                "namespace": "monitoring",
                "labels": {"release": "kps"},
                "interval": "30s",
            },
            "prometheusRule": {
                "enabled": True,
                "labels": {"release": "kps"},
                "kvCacheFullThreshold": 0.9,
            },
            "grafanaDashboard": {
                "enabled": True,
                "labels": {"grafana_dashboard": "1"},
                "annotations": {"grafana_folder": "kvpilot"},
            },
        }
    },
}


def value_paths(values: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every value in values.yaml, maps walked into (lists are leaves)."""
    if not isinstance(values, dict) or not values:
        return [prefix]
    return [p for key, child in values.items() for p in value_paths(child, f"{prefix}.{key}")]


def schema_at(path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = SCHEMA
    for key in path.strip(".").split("."):
        properties = (node or {}).get("properties")
        if properties is None:  # a free-form map (resources, podLabels ...): typed as a whole
            return node if (node or {}).get("type") == "object" else None
        node = properties.get(key)
    return node


def test_the_schema_covers_every_value() -> None:
    paths = value_paths(VALUES)
    assert len(paths) > 30
    missing = [path for path in paths if schema_at(path) is None]
    assert missing == []
    # ...and refuses what it does not know (a typo is an error, not a silent default).
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="loglevel"):
        chart.validate_schema({"loglevel": "debug"})
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"monitoring": {"podMonitor": {"enable": True}}})


def test_every_toggle_changes_what_is_rendered() -> None:
    default = render()
    for name, values in TOGGLED.items():
        if name != "defaults":
            assert render(values) != default, name


def validate(manifest: dict[str, Any]) -> None:
    kind = manifest["kind"]
    if manifest["apiVersion"].startswith("monitoring.coreos.com/"):
        getattr(prometheus_operator, kind).model_validate(manifest)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize("name", sorted(TOGGLED))
def test_each_toggle_lints_and_renders_valid_manifests(name: str) -> None:
    values = TOGGLED[name]
    report = helm.lint(CHART, values, strict=True, namespace="kvpilot-system")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    docs = render(values)
    assert docs
    for manifest in docs:
        validate(manifest)


def test_what_the_operator_builds_is_valid_kubernetes() -> None:
    spec = parse_spec(
        yaml.safe_load((CHART.parents[1] / "examples" / "llama-3.1-8b-gpu.yaml").read_text())[
            "spec"
        ]
        | {
            "runtimeClassName": "nvidia",
            "networkPolicy": {"allowNamespaces": ["web"]},
            "priorityClassName": "llm",
        }
    )
    owner = Owner(name="llama", namespace="serving", uid="5f0c7a9e-0000-4000-8000-000000000000")
    built = [
        build_deployment(owner, spec, default_image="kvpilot:1", replicas=2),
        build_service(owner),
        build_pod_disruption_budget(owner, spec),
        build_network_policy(owner, spec),
    ]
    assert all(manifest is not None for manifest in built)
    for manifest in built:
        validate(manifest)  # type: ignore[arg-type]


def test_a_values_change_rolls_the_operator() -> None:
    def checksum(values: dict[str, Any]) -> str:
        (deployment,) = of_kind(render(values), "Deployment")
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/values"]

    assert checksum({}) == checksum({})  # an upgrade with the same values restarts nothing
    # Values the operator's own arguments never show roll it too.
    for values in ({"rbac": {"create": False}}, {"monitoring": {"podMonitor": {"enabled": True}}}):
        assert checksum(values) != checksum({}), values


def previous_examples() -> list[Path]:
    return sorted(PREVIOUS.glob("*.yaml"), key=str)


def test_custom_resources_of_the_previous_crd_read_under_this_one() -> None:
    crd = crdgen.build_crd()
    examples = [p for p in previous_examples() if p.name != crdgen.CRD_FILE]
    assert len(examples) >= 3
    for path in examples:
        obj = yaml.safe_load(path.read_text())
        assert api_server_errors(crd, obj) == [], path.name
        parse_spec(obj["spec"])  # and the operator reconciles them


def test_no_field_of_the_previous_crd_was_removed_or_retyped() -> None:
    previous = yaml.safe_load((PREVIOUS / crdgen.CRD_FILE).read_text())
    current = crdgen.build_crd()
    assert [v["name"] for v in previous["spec"]["versions"]] == [
        v["name"] for v in current["spec"]["versions"]
    ]
    now = dict(walk_schema(crd_schema(current)))
    for path, node in walk_schema(crd_schema(previous)):
        assert path in now, f"{path} is gone: CRs that set it would no longer apply"
        assert now[path].get("type") == node.get("type"), path
