"""Validates objects against the CRD the way the API server does: the OpenAPI schema (strict
about unknown fields, like `kubectl apply --validate=strict`) and the CEL rules, evaluated by
cel-python. Without a cluster this is the closest honest stand-in for `kubectl apply`.
"""

from __future__ import annotations

from typing import Any

import celpy
import jsonschema


def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """A structural schema node -> JSON Schema (draft 7) that jsonschema can check."""
    out: dict[str, Any] = {}
    for key in ("type", "enum", "pattern", "minLength", "maxLength", "minItems", "maxItems"):
        if key in node:
            out[key] = node[key]
    if "required" in node:
        out["required"] = node["required"]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if bound in node:
            # OpenAPI v3.0 marks exclusivity with a boolean next to the bound.
            out[exclusive if node.get(exclusive) else bound] = node[bound]
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if "additionalProperties" in node:
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    return out


def _schema_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[Any]:
    validator = jsonschema.Draft7Validator(to_json_schema(crd_schema(crd)))
    return list(validator.iter_errors(obj))


def _text(error: Any) -> str:
    return f"{'.'.join(str(p) for p in error.absolute_path)}: {error.message}"


def schema_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    return [_text(error) for error in _schema_errors(crd, obj)]


def cel_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Evaluates every x-kubernetes-validations rule where its node has a value."""
    environment = celpy.Environment()
    errors: list[str] = []

    def walk(node: dict[str, Any], value: Any, path: str) -> None:
        if value is None:
            return
        for rule in node.get("x-kubernetes-validations", []):
            program = environment.program(environment.compile(rule["rule"]))
            result = program.evaluate({"self": celpy.json_to_cel(value)})
            if not isinstance(result, celpy.celtypes.BoolType) or not result:
                errors.append(f"{path or '<root>'}: {rule['message']}")
        if isinstance(value, dict):
            for name, child in node.get("properties", {}).items():
                walk(child, value.get(name), f"{path}.{name}".lstrip("."))
        if isinstance(value, list) and "items" in node:
            for index, item in enumerate(value):
                walk(node["items"], item, f"{path}[{index}]")

    walk(crd_schema(crd), obj, "")
    return errors


def api_server_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """As the API server: a value of the wrong type or outside its enum blocks the CEL rules
    (they are not evaluated on such an object); other schema errors do not."""
    errors = _schema_errors(crd, obj)
    texts = [_text(error) for error in errors]
    if any(error.validator in ("type", "enum") for error in errors):
        return texts
    return texts + cel_errors(crd, obj)


def walk_schema(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every (path, node) of a structural schema."""
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += walk_schema(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            found += walk_schema(node[key], f"{path}[{key}]")
    return found
