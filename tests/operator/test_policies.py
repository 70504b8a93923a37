"""Disruption and placement: the PodDisruptionBudget, the NetworkPolicy and the pods' topology
spread and runtime class, built from the spec (pure builders, table-driven)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.builders import Owner, build_deployment, owner_reference
from kvpilot.operator.policies import build_network_policy, build_pod_disruption_budget
from kvpilot.operator.spec import InvalidSpecError, parse_spec

OWNER = Owner(name="chat", namespace="serving", uid="uid-1")
BUILTIN = {"uri": "builtin://smollm2-135m-instruct"}
SELECTOR = {"app.kubernetes.io/name": "kvpilot-engine", "app.kubernetes.io/instance": "chat"}


def spec(**fields: Any) -> Any:
    return parse_spec({"model": BUILTIN, **fields})


def pod_spec(**fields: Any) -> dict[str, Any]:
    manifest = build_deployment(OWNER, spec(**fields), default_image="img:1", replicas=1)
    return manifest["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("fields", "has_budget"),
    [
        ({}, False),  # one replica: a budget would hold every drain forever
        ({"replicas": 1}, False),
        ({"replicas": 0}, False),
        ({"replicas": 2}, True),
        ({"autoscaling": {"maxReplicas": 1}}, False),
        ({"autoscaling": {"minReplicas": 1, "maxReplicas": 3}}, True),  # may have 1 right now
    ],
)
def test_a_budget_for_services_that_can_run_more_than_one_replica(
    fields: dict[str, Any], has_budget: bool
) -> None:
    budget = build_pod_disruption_budget(OWNER, spec(**fields))
    assert (budget is not None) == has_budget


def test_the_budget_never_blocks_a_drain_for_good() -> None:
    budget = build_pod_disruption_budget(OWNER, spec(replicas=3))
    assert budget is not None
    assert budget["apiVersion"] == "policy/v1" and budget["kind"] == "PodDisruptionBudget"
    assert budget["metadata"]["name"] == "chat"
    assert budget["metadata"]["ownerReferences"] == [owner_reference(OWNER)]
    # maxUnavailable, not minAvailable: at one replica left, that one may still be evicted;
    # pods that are not Ready never count against it.
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": SELECTOR},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }


def test_no_network_policy_unless_asked() -> None:
    assert build_network_policy(OWNER, spec()) is None


def test_the_network_policy_admits_kvpilots_pods_and_the_named_namespaces() -> None:
    policy = build_network_policy(
        OWNER, spec(networkPolicy={"allowNamespaces": ["web", "monitoring", "web"]})
    )
    assert policy is not None and policy["kind"] == "NetworkPolicy"
    assert policy["spec"]["podSelector"] == {"matchLabels": SELECTOR}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    kvpilot_pods, namespaces = rule["from"]
    # The operator (its autoscaler scrapes /metrics) and the router, from any namespace.
    assert kvpilot_pods == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvpilot"}},
    }
    assert namespaces["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring", "web"]}
    ]
    only_ours = build_network_policy(OWNER, spec(networkPolicy={}))
    assert only_ours is not None and len(only_ours["spec"]["ingress"][0]["from"]) == 1


def test_network_policy_namespaces_must_be_names() -> None:
    with pytest.raises(InvalidSpecError, match="allowNamespaces"):
        spec(networkPolicy={"allowNamespaces": ["Not_A_Namespace"]})


def test_pods_spread_across_nodes_and_zones_by_default() -> None:
    constraints = pod_spec()["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in constraints] == [
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    ]
    for constraint in constraints:
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"  # never leaves a pod Pending
        assert constraint["maxSkew"] == 1
        assert constraint["labelSelector"] == {"matchLabels": SELECTOR}
        assert constraint["matchLabelKeys"] == ["pod-template-hash"]


def test_the_spec_replaces_or_turns_off_the_spread() -> None:
    mine = {"maxSkew": 2, "topologyKey": "pool", "whenUnsatisfiable": "DoNotSchedule"}
    assert pod_spec(topologySpreadConstraints=[mine])["topologySpreadConstraints"] == [mine]
    assert "topologySpreadConstraints" not in pod_spec(topologySpreadConstraints=[])


@pytest.mark.parametrize(
    ("fields", "key", "expected"),
    [
        ({"runtimeClassName": "nvidia"}, "runtimeClassName", "nvidia"),
        ({"priorityClassName": "llm-high"}, "priorityClassName", "llm-high"),
        ({"nodeSelector": {"pool": "h100"}}, "nodeSelector", {"pool": "h100"}),
        (
            {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm"}]},
            "tolerations",
            [{"key": "dedicated", "operator": "Equal", "value": "llm"}],
        ),
        (
            {"affinity": {"nodeAffinity": {"x": 1}}},
            "affinity",
            {"nodeAffinity": {"x": 1}},
        ),
    ],
)
def test_placement_fields_reach_the_pods(fields: dict[str, Any], key: str, expected: Any) -> None:
    assert pod_spec(**fields)[key] == expected
    assert key not in pod_spec()
