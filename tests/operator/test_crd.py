"""The CRD: generated from the pydantic models, structural, and in agreement with them."""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.operator import crdgen
from kvpilot.operator.spec import InvalidSpecError, parse_spec, validate_name

from .crd_schema import api_server_errors, cel_errors, crd_schema, schema_errors, walk_schema

ROOT = Path(__file__).resolve().parents[2]
CRD = crdgen.build_crd()
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def isvc(spec: dict[str, Any], name: str = "chat") -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "serving"},
        "spec": spec,
    }


def pydantic_error(obj: dict[str, Any]) -> str | None:
    try:
        validate_name(obj["metadata"]["name"])
        parse_spec(obj["spec"])
    except InvalidSpecError as error:
        return str(error)
    return None


def test_generated_crd_files_are_up_to_date() -> None:
    stale = crdgen.stale_files(ROOT)
    assert not stale, f"regenerate with `python -m kvpilot.operator.crdgen`: {stale}"
    on_disk = yaml.safe_load((ROOT / "crds" / crdgen.CRD_FILE).read_text())
    assert on_disk == CRD


def test_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    for folder in crdgen.OUTPUT_DIRS:
        (tmp_path / folder).mkdir(parents=True)
        for name in crdgen.rendered_files():
            shutil.copy(ROOT / folder / name, tmp_path / folder / name)
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 0
    chart_copy = tmp_path / "charts/kvpilot/crds" / crdgen.CRD_FILE
    chart_copy.write_text(chart_copy.read_text().replace("kis", "isvc"))
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert crdgen.main(["--root", str(tmp_path)]) == 0  # regenerates
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 0


def test_schema_is_structural() -> None:
    for path, node in walk_schema(crd_schema(CRD)):
        assert "$ref" not in node and "title" not in node and "default" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "anyOf" not in node and "oneOf" not in node, path
        assert "type" in node, f"{path} has no type"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert node["type"] == "object", path


def test_every_field_has_a_description_for_kubectl_explain() -> None:
    schema = crd_schema(CRD)
    for top in ("spec", "status"):
        for path, node in walk_schema(schema["properties"][top], top):
            if path.endswith(("[items]", "[additionalProperties]")) and "properties" not in node:
                continue  # a list's scalar items / a map's values
            assert node.get("description"), f"{path} has no description"


def test_names_subresources_and_printer_columns() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "inferenceservices.kvpilot.dev"
    assert spec["group"] == "kvpilot.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceService"
    assert spec["names"]["shortNames"] == ["kis"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"]]
    assert columns == [
        "READY", "REPLICAS", "DESIRED", "MODEL", "URL", "REASON", "ADAPTERS", "AGE"
    ]  # fmt: skip
    # Every printer column and the scale paths point at fields the schema has.
    schema = crd_schema(CRD)
    for path in [c["jsonPath"] for c in version["additionalPrinterColumns"]] + [
        ".spec.replicas",
        ".status.replicas",
        ".status.selector",
    ]:
        assert schema_at(schema, path)["type"] in ("string", "integer", "object"), path


def schema_at(schema: dict[str, Any], json_path: str) -> dict[str, Any]:
    """The schema node a printer-column JSONPath selects (filters become "any item")."""
    node = schema
    for part in re.sub(r"\[\?\(.*?\)\]", "[]", json_path).strip(".").split("."):
        name, is_list = part.removesuffix("[]"), part.endswith("[]")
        if name == "metadata":
            return {"type": "object"}  # standard ObjectMeta, validated by the API server itself
        node = node["properties"][name]
        if is_list:
            node = node["items"]
    return node


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    obj["metadata"].setdefault("namespace", "default")
    assert api_server_errors(CRD, obj) == []
    assert pydantic_error(obj) is None


def test_there_are_gpu_and_cpu_examples() -> None:
    uris = {yaml.safe_load(p.read_text())["spec"]["model"]["uri"].split("://")[0] for p in EXAMPLES}
    assert {"hf", "builtin"} <= uris


# (change to a valid object, what the API server says, what the pydantic model says)
BAD = [
    (
        {"replicas": 2, "autoscaling": {"maxReplicas": 3}},
        "spec: spec.replicas and spec.autoscaling are mutually exclusive",
        "mutually exclusive",
    ),
    ({"replicas": -1}, "spec.replicas: -1 is less than the minimum of 0", "spec.replicas"),
    (
        {"model": {"uri": "s3://bucket/model"}},
        "spec.model.uri: 's3://bucket/model' does not match",
        "unknown scheme 's3'",
    ),
    (
        {"autoscaling": {"minReplicas": 4, "maxReplicas": 2}},
        "spec.autoscaling: autoscaling.minReplicas must be <= autoscaling.maxReplicas",
        "minReplicas (4) must be <= maxReplicas (2)",
    ),
    (
        {"autoscaling": {"maxReplicas": 2, "panicWindowSeconds": 30}},
        "autoscaling.panicWindowSeconds must be <= autoscaling.stableWindowSeconds",
        "spec.autoscaling: need 0 < panicWindowSeconds (30.0) <= stableWindowSeconds (20.0)",
    ),
    (
        {"autoscaling": {"maxReplicas": 2, "tolerance": 0.5, "panicThreshold": 1.2}},
        "autoscaling.panicThreshold must be > 1 + autoscaling.tolerance",
        "spec.autoscaling: panicThreshold (1.2) must exceed 1 + tolerance (1.5)",
    ),
    (
        {"replica": 1},
        "Additional properties are not allowed ('replica' was unexpected)",
        "Extra inputs",
    ),
    ({"engine": {"dtype": "fp8"}}, "spec.engine.dtype: 'fp8' is not one of", "spec.engine.dtype"),
    (
        {"resources": {"limits": {"memory": "lots"}}},
        "spec.resources.limits.memory: 'lots' does not match",
        "not a Kubernetes quantity",
    ),
    (
        {"engine": {"gpuMemoryUtilization": 0}},
        "spec.engine.gpuMemoryUtilization: 0 is less than or equal to the minimum of 0",
        "greater than 0",
    ),
]


@pytest.mark.parametrize(("change", "api_message", "model_message"), BAD)
def test_bad_objects_are_rejected_by_schema_cel_and_model(
    change: dict[str, Any], api_message: str, model_message: str
) -> None:
    obj = isvc({"model": {"uri": "builtin://smollm2-135m-instruct"}, **change})
    errors = api_server_errors(CRD, obj)
    assert any(api_message in error for error in errors), errors
    message = pydantic_error(obj)
    assert message is not None and model_message in message


@pytest.mark.parametrize("name", ["Chat", "9lives", "x" * 64])
def test_names_that_cannot_name_a_service_are_rejected(name: str) -> None:
    obj = isvc({"model": {"uri": "builtin://smollm2-135m-instruct"}}, name=name)
    assert any("DNS-1035 label" in error for error in cel_errors(CRD, obj))
    assert "DNS-1035 label" in (pydantic_error(obj) or "")


AGREEMENT = [
    {"replicas": 0},
    {"autoscaling": {"maxReplicas": 1}},
    {"autoscaling": {"minReplicas": 2, "maxReplicas": 2, "scaleDown": {"maxRate": 4}}},
    {"autoscaling": {"maxReplicas": 0}},
    {"autoscaling": {"maxReplicas": 2, "tolerance": 1}},
    # Cross-field limits, with the autoscaler's defaults where a field is left out.
    {"autoscaling": {"maxReplicas": 2, "panicWindowSeconds": 20}},
    {"autoscaling": {"maxReplicas": 2, "panicWindowSeconds": 21}},
    {"autoscaling": {"maxReplicas": 2, "stableWindowSeconds": 9}},
    {"autoscaling": {"maxReplicas": 2, "panicWindowSeconds": 30, "stableWindowSeconds": 60}},
    {"autoscaling": {"maxReplicas": 2, "panicThreshold": 1.1}},
    {"autoscaling": {"maxReplicas": 2, "panicThreshold": 1.11}},
    {"autoscaling": {"maxReplicas": 2, "tolerance": 0.9}},
    {"autoscaling": {"maxReplicas": 2, "tolerance": 0.9, "panicThreshold": 3}},
    {"gpus": 65},
    {"rollout": {"maxSurge": "25%", "maxUnavailable": 1}},
    {"engine": {"blockSize": 2048}},
    {"engine": {"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "a"}}}]}},
    {"engine": {"env": [{"value": "no name"}]}},
    {"tolerations": [{"operator": "Sometimes"}]},
    {"affinity": {"anything": {"goes": [1]}}},
    {"model": {"uri": "hf://org/name@v1", "allowPatterns": []}},
    {"model": {"uri": "pvc://claim/path", "cache": {"sizeLimit": "10Gi"}}},
    {"model": {"uri": "builtin://smollm2-135m-instruct", "servedName": "with space"}},
    {"drainSeconds": 3601},
]


@pytest.mark.parametrize("spec", AGREEMENT)
def test_schema_and_model_agree(spec: dict[str, Any]) -> None:
    obj = isvc({"model": {"uri": "builtin://smollm2-135m-instruct"}, **spec})
    api_ok = not api_server_errors(CRD, obj)
    model_ok = pydantic_error(obj) is None
    assert api_ok == model_ok, (api_server_errors(CRD, obj), pydantic_error(obj))


def test_status_written_by_the_operator_validates() -> None:
    obj = isvc({"model": {"uri": "builtin://smollm2-135m-instruct"}})
    obj["status"] = {
        "observedGeneration": 1,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Serving",
                "message": "1/1",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": 1,
            }
        ],
        "replicas": 1,
        "readyReplicas": 1,
        "updatedReplicas": 1,
        "desiredReplicas": 1,
        "selector": "a=b",
        "url": "http://chat.serving.svc:8000/v1",
        "model": "chat",
        "autoscaling": {"window": {"samples": [[1.0, 0.5]]}, "decisions": []},
    }
    assert schema_errors(CRD, copy.deepcopy(obj)) == []
