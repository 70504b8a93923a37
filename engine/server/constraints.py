"""A request's output constraint, from OpenAI's `response_format` or vLLM's extra parameters
(`structured_outputs`, and the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`), as one StructuredSpec, checked here so that a bad one is a 400 naming its
parameter before anything reaches the engine core."""

from __future__ import annotations

import json
from typing import Any

from kvpilot.contract.errors import bad_request
from kvpilot.contract.openai import ChatCompletionRequest, SamplingRequest
from kvpilot.engine.structured.backend import DEFAULT_BACKEND, GrammarError
from kvpilot.engine.structured.registry import to_grammar
from kvpilot.engine.structured.spec import StructuredSpec


def requested_spec(
    request: SamplingRequest, backend: str = DEFAULT_BACKEND
) -> tuple[StructuredSpec, str] | None:
    """The one constraint the request asks for and the parameter that asked; 400 for several."""
    found: list[tuple[StructuredSpec, str]] = []
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append((StructuredSpec("json_object"), "response_format"))
        else:
            if fmt.json_schema is None:
                raise bad_request(
                    "response_format.json_schema is required when type is json_schema.",
                    param="response_format",
                )
            schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
            found.append((_json_spec(schema, "response_format"), "response_format"))
    so = request.structured_outputs
    if so is not None:
        given = [
            (k, v)
            for k, v in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise bad_request(
                "structured_outputs takes one of json, regex, choice, grammar, json_object; got "
                + ", ".join(k for k, _ in given),
                param="structured_outputs",
            )
        for kind, value in given:
            found.append((_spec(kind, value, "structured_outputs"), "structured_outputs"))
    for kind, name in (
        ("json", "guided_json"),
        ("regex", "guided_regex"),
        ("choice", "guided_choice"),
        ("grammar", "guided_grammar"),
    ):
        value = getattr(request, name)
        if value is not None:
            found.append((_spec(kind, value, name), name))
    if len(found) > 1:
        raise bad_request(
            "Only one output constraint may be given; got " + ", ".join(p for _, p in found) + ".",
            param=found[1][1],
        )
    if request.guided_decoding_backend not in (None, "auto", backend):
        # The engine compiles with one backend (vLLM too refuses a request naming another).
        raise bad_request(
            f"guided_decoding_backend must be auto or {backend}, this server's backend.",
            param="guided_decoding_backend",
        )
    return found[0] if found else None


def _spec(kind: str, value: Any, param: str) -> StructuredSpec:
    if kind == "json":
        return _json_spec(value, param)
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "choice":
        if not value:
            raise bad_request(f"{param}: choice must not be empty.", param=param)
        return StructuredSpec.choice(list(value))
    return StructuredSpec(kind, value)  # type: ignore[arg-type]


def _json_spec(schema: Any, param: str) -> StructuredSpec:
    if isinstance(schema, str):  # vLLM takes the schema as JSON text too
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(
                f"{param}: the JSON schema is not valid JSON: {exc}", param=param
            ) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be an object.", param=param)
    return StructuredSpec.json_schema(schema)


def checked(spec: StructuredSpec, param: str, backend: str = DEFAULT_BACKEND) -> StructuredSpec:
    """spec, once the grammar backend has accepted it; else a 400 naming param."""
    try:
        to_grammar(spec, backend)
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
    return spec


def request_constraint(
    request: SamplingRequest, backend: str = DEFAULT_BACKEND
) -> StructuredSpec | None:
    """The request's checked constraint (None: free text). Tool choice adds its own (tools/)."""
    found = requested_spec(request, backend)
    if found is None:
        return None
    if isinstance(request, ChatCompletionRequest) and request.forces_tool_call:
        raise bad_request(
            f"{found[1]} cannot be combined with tool_choice {request.tool_choice!r}.",
            param=found[1],
        )
    return checked(*found, backend)
