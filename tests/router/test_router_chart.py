"""The chart's router: a Deployment of two or more routers behind a Service, whose arguments the
real `kvpilot router` CLI accepts, with exactly the permissions the router's calls need."""

from __future__ import annotations

from kvpilot.operator.config import config_from
from kvpilot.router.cli import parse_args

from ..operator.chart import of_kind, rbac_allows, render

ROUTER_CALLS = (
    ("kvpilot.dev", "inferenceservices", "list"),
    ("kvpilot.dev", "inferenceservices", "watch"),
    ("kvpilot.dev", "inferenceservices", "patch"),  # the wake annotation
    ("", "pods", "list"),
    ("", "pods", "watch"),
)


def test_router_deployment_service_and_rbac() -> None:
    docs = render(component="router")
    assert sorted(d["kind"] for d in docs) == [
        "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount",
    ]  # fmt: skip
    (deployment,) = of_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # The image has no ENTRYPOINT: the command names the program, the args its subcommand.
    assert container["command"] == ["kvpilot"] and container["args"][0] == "router"
    config = parse_args(container["args"][1:])
    assert config.namespaces == ("",) and config.port == 8080 and config.hold.timeout_s == 300
    assert pod["serviceAccountName"] == deployment["metadata"]["name"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    # The engines' NetworkPolicy admits pods of this label: without it no request would pass.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/part-of"] == "kvpilot"
    (service,) = of_kind(docs, "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (role,) = of_kind(docs, "ClusterRole")
    assert all(rbac_allows(role["rules"], *call) for call in ROUTER_CALLS)
    assert not rbac_allows(role["rules"], "", "secrets", "get")
    assert not rbac_allows(role["rules"], "apps", "deployments", "patch")


def test_router_follows_the_watched_namespaces_or_can_be_left_out() -> None:
    docs = render({"watchNamespaces": ["a", "b"]}, component="router")
    assert sorted(b["metadata"]["namespace"] for b in of_kind(docs, "RoleBinding")) == ["a", "b"]
    (deployment,) = of_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert parse_args(args[1:]).namespaces == ("a", "b")
    assert render({"router": {"enabled": False}}, component="router") == []


def test_the_operator_shows_the_routers_url_as_every_services_endpoint() -> None:
    def operator_args(values: dict | None = None) -> list[str]:
        (deployment,) = of_kind(render(values), "Deployment")
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]

    config = config_from(operator_args(), {})
    assert config.router_url == "http://kvpilot-router.kvpilot-system.svc:80/v1"
    assert config_from(operator_args({"router": {"enabled": False}}), {}).router_url is None
    # ... and reads the routers' held requests: their pods, by exactly the router's labels.
    assert config.router_namespace == "kvpilot-system"
    (router,) = of_kind(render(component="router"), "Deployment")
    assert (
        dict(item.split("=") for item in config.router_selector.split(","))
        == router["spec"]["selector"]["matchLabels"]
    )
    assert config_from(operator_args({"router": {"enabled": False}}), {}).router_namespace is None


def test_the_router_reads_engine_keys_with_get_alone_and_only_when_asked() -> None:
    def rules(values: dict[str, object] | None) -> list[dict[str, object]]:
        (role,) = of_kind(render(values, component="router"), "ClusterRole")
        return role["rules"]

    assert not rbac_allows(rules(None), "", "secrets", "get")
    asked = rules({"rbac": {"readApiKeySecrets": True}})
    assert rbac_allows(asked, "", "secrets", "get")
    # One named Secret at a time: never every Secret of a namespace.
    assert not rbac_allows(asked, "", "secrets", "list")
    assert not rbac_allows(asked, "", "secrets", "watch")
    # With tenancy the router already watches Secrets: one rule, no duplicate.
    both = rules({"rbac": {"readApiKeySecrets": True}, "tenancy": {"enabled": True}})
    assert sum("secrets" in r["resources"] for r in both) == 1
