"""Kubernetes shapes the InferenceService spec reuses (quantities, env vars, tolerations ...)
as pydantic models, with the CRD schema each should produce.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from kubernetes.utils import parse_quantity
from pydantic import AfterValidator, Field, WithJsonSchema

from kvpilot.contract.kube_model import KubeModel

# apimachinery's resource.Quantity grammar, as the CRD pattern controller-gen emits: the API
# server checks it at apply time, and the operator parses with kubernetes.utils.parse_quantity.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
    r"(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, bool) or not (
        isinstance(value, int) or re.fullmatch(QUANTITY_PATTERN, value)
    ):
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity (examples: 500m, 2, 16Gi, 1.5G, 1e3)"
        )
    parse_quantity(value)
    return value


def _check_int_or_percent(value: int | str) -> int | str:
    if isinstance(value, str) and not re.fullmatch(r"[0-9]+%", value):
        raise ValueError(f"{value!r} must be an integer or a percentage such as '25%'")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{value} must be >= 0")
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
IntOrPercent = Annotated[
    int | str,
    AfterValidator(_check_int_or_percent),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
        }
    ),
]
# Free-form Kubernetes structures we pass through untouched (the API server validates them as
# part of the Deployment): the CRD keeps them instead of pruning unknown fields.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


class SecretKeyRef(KubeModel):
    """A key of a Secret in the InferenceService's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")
    key: str = Field(
        default="HF_TOKEN", min_length=1, description="Key in the Secret that holds the token."
    )


class EnvVar(KubeModel):
    """An environment variable of the engine container (and the model download)."""

    name: str = Field(min_length=1, description="Name of the variable.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: FreeForm | None = Field(
        default=None,
        description="A source for the value (secretKeyRef, configMapKeyRef, fieldRef, ...).",
    )


class ResourceRequirements(KubeModel):
    """Compute resources of the engine container (as in a Pod)."""

    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources, e.g. {cpu: 4, memory: 16Gi}."
    )
    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources the scheduler reserves."
    )


class Toleration(KubeModel):
    """A toleration of the engine pods (as in a Pod)."""

    key: str | None = Field(default=None, description="Taint key; empty matches all keys.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (the default)."
    )
    value: str | None = Field(default=None, description="Taint value, for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound after the taint."
    )
