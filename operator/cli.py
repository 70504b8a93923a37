"""`kvpilot operator`: runs the kopf operator with its liveness endpoint and its own /metrics.
Imports no torch."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import kopf
from prometheus_client import CollectorRegistry, start_http_server

from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.config import OperatorConfig, config_from
from kvpilot.operator.handlers import build_registry
from kvpilot.operator.kube import KubeApi

logger = logging.getLogger(__name__)


def configure_logging(config: OperatorConfig) -> None:
    log_format = kopf.LogFormat.JSON if config.log_format == "json" else kopf.LogFormat.FULL
    kopf.configure(debug=config.log_level == "debug", log_format=log_format)
    logging.getLogger().setLevel(config.log_level.upper())
    # urllib3's per-request chatter would drown the operator's own lines.
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)


class MetricsPortError(RuntimeError):
    """The operator's /metrics port cannot be bound (taken, or privileged)."""


@contextmanager
def serving_metrics(port: int, registry: CollectorRegistry) -> Iterator[None]:
    """The operator's /metrics on 0.0.0.0:port for as long as the operator runs (0: none)."""
    if not port:
        yield
        return
    try:
        server, thread = start_http_server(port, registry=registry)
    except OSError as error:
        raise MetricsPortError(f"cannot serve metrics on port {port}: {error}") from error
    logger.info("serving the operator's metrics on :%d/metrics", port)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def run_operator(
    config: OperatorConfig,
    *,
    api: KubeApi | None = None,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
    metrics_registry: CollectorRegistry | None = None,
) -> None:
    """Blocks until SIGTERM/SIGINT (or `stop_flag`, for embedding and tests).

    The operator's metrics go to `metrics_registry` (a fresh one by default; never the global
    registry), served on config.metrics_port. Raises MetricsPortError when that port is taken.
    """
    registry = metrics_registry if metrics_registry is not None else CollectorRegistry()
    metrics = OperatorMetrics(registry)
    with serving_metrics(config.metrics_port, registry):
        kopf.run(
            registry=build_registry(config, api, metrics),
            # One replica with a Recreate strategy (the chart's): no peering objects needed.
            standalone=True,
            clusterwide=config.is_clusterwide,
            namespaces=config.namespaces,
            liveness_endpoint=config.liveness_endpoint,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )


def main(argv: list[str]) -> int:
    try:
        config = config_from(argv, os.environ)
    except SystemExit as exit_:  # argparse: --help, or a usage error it already printed
        return exit_.code if isinstance(exit_.code, int) else 2
    except ValueError as error:
        print(f"kvpilot operator: {error}", file=sys.stderr)
        return 2
    configure_logging(config)
    try:
        run_operator(config)
    except MetricsPortError as error:
        print(f"kvpilot operator: {error}", file=sys.stderr)
        return 1
    return 0
