"""How kvpilot's custom resources are modelled in pydantic (the operator's InferenceService and
Tenant specs; the router reads Tenants with the same model): the base every spec model shares,
and a validation error in the CRD's own field names."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel


class KubeModel(BaseModel):
    # strict: no coercion ("yes" -> True, "8" -> 8, 8.0 -> 8), as the API server's schema
    # allows none; what the CRD refuses, the model refuses too (an object stored under an older
    # CRD, or applied where the schema is not enforced, gets InvalidSpec rather than a guess).
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        strict=True,
    )


class InvalidSpecError(ValueError):
    """A custom resource's spec that the model refuses; the message names each problem."""


def format_validation_error(error: ValidationError) -> str:
    """'spec.engine.blockSize: Input should be ...; spec.model: ...' in the CRD's field names."""
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(["spec", *(str(part) for part in item["loc"])])
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}")
    return "; ".join(problems)
