"""The operator's settings, from `kvpilot operator` flags and KVPILOT_* environment variables."""

from __future__ import annotations

import argparse
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.contract.kube import ENGINE_PORT
from kvpilot.operator.constants import (
    DEFAULT_ANNOTATION_PREFIX,
    DEFAULT_API_TIMEOUT_SECONDS,
    DEFAULT_ENGINE_IMAGE,
    DEFAULT_LIVENESS_PORT,
    DEFAULT_METRICS_PORT,
)

LOG_LEVELS = ("debug", "info", "warning", "error")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
# The chart's router pods (charts/kvpilot/templates/router.yaml); the chart adds its release.
ROUTER_SELECTOR = "app.kubernetes.io/component=router,app.kubernetes.io/part-of=kvpilot"


def parse_selector(text: str) -> dict[str, str]:
    """ "k=v,k2=v2" -> {k: v, k2: v2}; ValueError for anything else (only equality selectors)."""
    selector: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value):
            raise ValueError(f"label selector {text!r}: {item!r} is not key=value")
        selector[key] = value
    return selector


@dataclass(frozen=True)
class OperatorConfig:
    """namespaces=() watches the whole cluster."""

    namespaces: tuple[str, ...] = ()
    engine_image: str = DEFAULT_ENGINE_IMAGE
    annotation_prefix: str = DEFAULT_ANNOTATION_PREFIX
    log_level: str = "info"
    log_format: str = "plain"
    # How often every InferenceService is re-read and its status refreshed even if nothing we
    # watch changed (pods crash-looping change no Deployment field).
    resync_seconds: float = 30.0
    liveness_endpoint: str | None = f"http://0.0.0.0:{DEFAULT_LIVENESS_PORT}/healthz"
    max_workers: int = 8
    # The autoscaler's timer fires this often for every InferenceService with spec.autoscaling;
    # a spec's autoscaling.intervalSeconds can space its decisions further apart, not closer.
    autoscale_interval_seconds: float = 5.0
    # Each API call of the operator's own code (reads, applies, status patches) may take this long
    # (connecting at most 5 s of it) before it fails and is retried with backoff.
    api_timeout_seconds: float = DEFAULT_API_TIMEOUT_SECONDS
    # One scrape of an engine pod's /metrics may take this long before the pod counts as missing.
    scrape_timeout_seconds: float = 1.0
    # The adapter sync's timer fires this often for every InferenceService with LoRA adapters:
    # how soon a spec change reaches the replicas, and a new replica gets the adapters.
    adapter_sync_seconds: float = 10.0
    # How long the engine may take to load one adapter (downloading an hf:// one included)
    # before that replica shows it Loading and the next round looks again.
    adapter_load_timeout_seconds: float = 120.0
    # Every Tenant is checked again this often (its Secrets, its grants against the served
    # models): how soon a Secret created after its Tenant makes the Tenant Ready.
    tenant_check_seconds: float = 30.0
    # The operator's own Prometheus /metrics on 0.0.0.0:PORT; 0 serves none.
    metrics_port: int = DEFAULT_METRICS_PORT
    # The engine pods' port the autoscaler scrapes: the engine's, always, in a cluster. A setting
    # so that tests can serve many fake pods' /metrics on loopback without owning port 8000.
    engine_metrics_port: int = ENGINE_PORT
    # kvpilot router's OpenAI base URL, when one serves these InferenceServices: it is then each
    # one's status.endpoint (the URL users call); None: the service's own URL.
    router_url: str | None = None
    # Where the kvpilot router pods run (the chart's release namespace) and their labels: the
    # autoscaler reads each one's held and in-flight requests per InferenceService from its
    # /metrics. None: no router is scraped.
    router_namespace: str | None = None
    router_selector: str = ROUTER_SELECTOR

    def __post_init__(self) -> None:
        if self.router_namespace is not None and not _DNS_LABEL.fullmatch(self.router_namespace):
            raise ValueError(f"router namespace {self.router_namespace!r} is not a valid name")
        parse_selector(self.router_selector)
        if self.router_url is not None and not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"the router URL must be http(s)://..., got {self.router_url!r}")
        for namespace in self.namespaces:
            if not _DNS_LABEL.fullmatch(namespace):
                raise ValueError(f"namespace {namespace!r} is not a valid namespace name")
        if not self.engine_image.strip():
            raise ValueError("the default engine image must not be empty")
        prefix = self.annotation_prefix
        if len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix):
            raise ValueError(
                f"annotation prefix {prefix!r} must be a DNS subdomain such as kvpilot.dev"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in ("plain", "json"):
            raise ValueError(f"log format {self.log_format!r} is not plain or json")
        if not self.resync_seconds > 0:
            raise ValueError(f"resync seconds must be > 0, got {self.resync_seconds}")
        if self.max_workers < 1:
            raise ValueError(f"max workers must be >= 1, got {self.max_workers}")
        if not self.autoscale_interval_seconds > 0:
            raise ValueError(
                f"autoscale interval must be > 0 seconds, got {self.autoscale_interval_seconds}"
            )
        if not 0 < self.api_timeout_seconds < float("inf"):
            raise ValueError(f"API timeout must be > 0 seconds, got {self.api_timeout_seconds}")
        if not self.adapter_sync_seconds > 0:
            raise ValueError(
                f"adapter sync interval must be > 0 seconds, got {self.adapter_sync_seconds}"
            )
        if not self.tenant_check_seconds > 0:
            raise ValueError(
                f"tenant check interval must be > 0 seconds, got {self.tenant_check_seconds}"
            )
        if not self.adapter_load_timeout_seconds > 0:
            raise ValueError(
                f"adapter load timeout must be > 0 seconds, got {self.adapter_load_timeout_seconds}"
            )
        if not self.scrape_timeout_seconds > 0:
            raise ValueError(
                f"scrape timeout must be > 0 seconds, got {self.scrape_timeout_seconds}"
            )
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be in [0, 65535], got {self.metrics_port}")
        if self.metrics_port and self.metrics_port == _port_of(self.liveness_endpoint):
            raise ValueError(
                f"metrics port {self.metrics_port} is the liveness endpoint's: use another, or 0"
            )
        if not 1 <= self.engine_metrics_port <= 65535:
            raise ValueError(
                f"engine metrics port must be in [1, 65535], got {self.engine_metrics_port}"
            )

    @property
    def is_clusterwide(self) -> bool:
        return not self.namespaces


def _port_of(url: str | None) -> int | None:
    try:
        return urllib.parse.urlsplit(url).port if url else None
    except ValueError:
        return None  # kopf reports a malformed endpoint itself


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpilot operator",
        description="Run the kvpilot Kubernetes operator (InferenceService -> engine pods).",
        epilog="Each flag falls back to its KVPILOT_* environment variable, then the default.",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch only this namespace (repeatable; env KVPILOT_WATCH_NAMESPACES, "
        "comma-separated; default: all namespaces)",
    )
    parser.add_argument(
        "--engine-image",
        help="engine image when spec.engine.image is not set (env KVPILOT_ENGINE_IMAGE; "
        f"default {DEFAULT_ENGINE_IMAGE})",
    )
    parser.add_argument(
        "--annotation-prefix",
        help="prefix of kopf's state annotations and finalizer on InferenceServices "
        f"(env KVPILOT_ANNOTATION_PREFIX; default {DEFAULT_ANNOTATION_PREFIX})",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, help="env KVPILOT_LOG_LEVEL; default info"
    )
    parser.add_argument(
        "--log-format", choices=("plain", "json"), help="env KVPILOT_LOG_FORMAT; default plain"
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        help="status refresh period of every InferenceService (env KVPILOT_RESYNC_SECONDS; "
        "default 30)",
    )
    parser.add_argument(
        "--liveness-endpoint",
        help="kopf's liveness endpoint, or 'none' (env KVPILOT_LIVENESS_ENDPOINT; default "
        f"http://0.0.0.0:{DEFAULT_LIVENESS_PORT}/healthz)",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        help="threads running reconciles (env KVPILOT_MAX_WORKERS; default 8)",
    )
    parser.add_argument(
        "--autoscale-interval",
        type=float,
        metavar="SECONDS",
        help="how often the autoscaler looks at each InferenceService with spec.autoscaling "
        "(env KVPILOT_AUTOSCALE_INTERVAL; default 5)",
    )
    parser.add_argument(
        "--api-timeout",
        type=float,
        metavar="SECONDS",
        help="timeout of each Kubernetes API call the operator makes; a timed-out call is "
        "retried with backoff (env KVPILOT_API_TIMEOUT; default "
        f"{DEFAULT_API_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--scrape-timeout",
        type=float,
        metavar="SECONDS",
        help="timeout of one scrape of an engine pod's /metrics (env KVPILOT_SCRAPE_TIMEOUT; "
        "default 1)",
    )
    parser.add_argument(
        "--adapter-sync-interval",
        type=float,
        metavar="SECONDS",
        help="how often the LoRA adapters of each InferenceService with spec.adapters are "
        "brought into its Ready replicas (env KVPILOT_ADAPTER_SYNC_INTERVAL; default 10)",
    )
    parser.add_argument(
        "--tenant-check-interval",
        type=float,
        metavar="SECONDS",
        help="how often every Tenant's Secrets and grants are checked again (env "
        "KVPILOT_TENANT_CHECK_INTERVAL; default 30)",
    )
    parser.add_argument(
        "--adapter-load-timeout",
        type=float,
        metavar="SECONDS",
        help="how long an engine may take to load one adapter, a download included, before "
        "the next round looks again (env KVPILOT_ADAPTER_LOAD_TIMEOUT; default 120)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the operator's own Prometheus /metrics on this port, 0 for none "
        f"(env KVPILOT_METRICS_PORT; default {DEFAULT_METRICS_PORT})",
    )
    parser.add_argument(
        "--router-namespace",
        metavar="NAMESPACE",
        help="the namespace of kvpilot's router pods, whose held and in-flight requests take "
        "part in autoscaling (env KVPILOT_ROUTER_NAMESPACE; default: none, no router is read)",
    )
    parser.add_argument(
        "--router-selector",
        metavar="KEY=VALUE,...",
        help=f"labels of the router pods (env KVPILOT_ROUTER_SELECTOR; default {ROUTER_SELECTOR})",
    )
    parser.add_argument(
        "--router-url",
        help="kvpilot router's OpenAI base URL, shown as each InferenceService's endpoint "
        "(env KVPILOT_ROUTER_URL; default: none, the service's own URL)",
    )
    return parser


def config_from(argv: list[str], env: Mapping[str, str]) -> OperatorConfig:
    """Flags win over the environment, which wins over the defaults. Raises ValueError."""
    args = build_parser().parse_args(argv)

    def given(flag: object, name: str) -> str | None:
        if flag is not None:
            return str(flag)
        return env.get(name, "").strip() or None

    fields: dict[str, object] = {}
    if args.namespaces:
        fields["namespaces"] = tuple(ns for item in args.namespaces for ns in item.split(",") if ns)
    else:
        listed = env.get("KVPILOT_WATCH_NAMESPACES", "").split(",")
        fields["namespaces"] = tuple(ns.strip() for ns in listed if ns.strip())
    for field, flag, name in (
        ("engine_image", args.engine_image, "KVPILOT_ENGINE_IMAGE"),
        ("annotation_prefix", args.annotation_prefix, "KVPILOT_ANNOTATION_PREFIX"),
        ("log_level", args.log_level, "KVPILOT_LOG_LEVEL"),
        ("log_format", args.log_format, "KVPILOT_LOG_FORMAT"),
        ("router_url", args.router_url, "KVPILOT_ROUTER_URL"),
        ("router_namespace", args.router_namespace, "KVPILOT_ROUTER_NAMESPACE"),
        ("router_selector", args.router_selector, "KVPILOT_ROUTER_SELECTOR"),
    ):
        value = given(flag, name)
        if value is not None:
            fields[field] = value.lower() if field.startswith("log_") else value
    for field, flag, name, convert in (
        ("resync_seconds", args.resync_seconds, "KVPILOT_RESYNC_SECONDS", float),
        ("max_workers", args.max_workers, "KVPILOT_MAX_WORKERS", int),
        (
            "autoscale_interval_seconds",
            args.autoscale_interval,
            "KVPILOT_AUTOSCALE_INTERVAL",
            float,
        ),
        ("scrape_timeout_seconds", args.scrape_timeout, "KVPILOT_SCRAPE_TIMEOUT", float),
        ("api_timeout_seconds", args.api_timeout, "KVPILOT_API_TIMEOUT", float),
        (
            "adapter_sync_seconds",
            args.adapter_sync_interval,
            "KVPILOT_ADAPTER_SYNC_INTERVAL",
            float,
        ),
        (
            "tenant_check_seconds",
            args.tenant_check_interval,
            "KVPILOT_TENANT_CHECK_INTERVAL",
            float,
        ),
        (
            "adapter_load_timeout_seconds",
            args.adapter_load_timeout,
            "KVPILOT_ADAPTER_LOAD_TIMEOUT",
            float,
        ),
        ("metrics_port", args.metrics_port, "KVPILOT_METRICS_PORT", int),
    ):
        value = given(flag, name)
        if value is not None:
            try:
                fields[field] = convert(value)
            except ValueError:
                raise ValueError(f"{name} must be a number, got {value!r}") from None
    liveness = given(args.liveness_endpoint, "KVPILOT_LIVENESS_ENDPOINT")
    if liveness is not None:
        fields["liveness_endpoint"] = None if liveness.lower() == "none" else liveness
    return OperatorConfig(**fields)  # type: ignore[arg-type]
