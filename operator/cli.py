"""`kvpilot operator`: runs the kopf operator with its liveness endpoint. Imports no torch."""

from __future__ import annotations

import logging
import os
import sys
import threading

import kopf

from kvpilot.operator.config import OperatorConfig, config_from
from kvpilot.operator.handlers import build_registry
from kvpilot.operator.kube import KubeApi


def configure_logging(config: OperatorConfig) -> None:
    log_format = kopf.LogFormat.JSON if config.log_format == "json" else kopf.LogFormat.FULL
    kopf.configure(debug=config.log_level == "debug", log_format=log_format)
    logging.getLogger().setLevel(config.log_level.upper())
    # urllib3's per-request chatter would drown the operator's own lines.
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def run_operator(
    config: OperatorConfig,
    *,
    api: KubeApi | None = None,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
) -> None:
    """Blocks until SIGTERM/SIGINT (or `stop_flag`, for embedding and tests)."""
    kopf.run(
        registry=build_registry(config, api),
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
    run_operator(config)
    return 0
