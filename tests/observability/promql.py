"""Metric names a PromQL expression reads, found by a real PromQL parser (promql-parser)."""

from __future__ import annotations

import promql_parser

# Grafana's variables, replaced by values of the same PromQL type before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m"}


def metric_names(expr: str) -> set[str]:
    """Every metric a query selects; raises ValueError when the query does not parse."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    names: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if not node.name:
                raise ValueError(f"a selector without a metric name: {expr}")
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names
