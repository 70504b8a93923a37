"""spec.adapters and spec.engine.lora: what the API server refuses (the generated CRD's schema and
CEL rules, evaluated as the API server does), what the operator refuses (InvalidSpec), and the
pod they give: LoRA flags and limits, never the adapters themselves."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpilot.contract.lora import DEFAULT_MAX_LORA_RANK, RUNTIME_LORA_FLAG
from kvpilot.engine.server.from_flags import engine_config, parse_flags
from kvpilot.operator import crdgen
from kvpilot.operator.builders import Owner, build_deployment, build_engine_args
from kvpilot.operator.memory import cpu_memory_need, limit_problem
from kvpilot.operator.spec import InvalidSpecError, check_adapter_names, parse_spec

from .crd_schema import api_server_errors, crd_schema

CRD = crdgen.build_crd()
MODEL = {"uri": "hf://org/base"}
OWNER = Owner(name="chat", namespace="serving", uid="u-1")


def isvc(spec: dict[str, Any], name: str = "chat") -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "serving"},
        "spec": spec,
    }


def refusals(spec: dict[str, Any], name: str = "chat") -> tuple[list[str], str | None]:
    """(the API server's errors, the operator's InvalidSpec message) for one spec."""
    try:
        check_adapter_names(parse_spec(spec), spec["model"].get("servedName") or name)
        invalid = None
    except InvalidSpecError as error:
        invalid = str(error)
    return api_server_errors(CRD, isvc(spec, name)), invalid


def with_adapters(*adapters: dict[str, Any], **engine: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": dict(MODEL), "adapters": list(adapters)}
    if engine:
        spec["engine"] = engine
    return spec


@pytest.mark.parametrize(
    ("spec", "server_says", "operator_says"),
    [
        (
            with_adapters({"name": "-sql", "uri": "hf://org/sql"}),
            "does not match",
            "adapter name '-sql' must be 1-63 letters",
        ),
        (
            with_adapters({"name": "s" * 64, "uri": "hf://org/sql"}),
            "is too long",
            "adapter name",
        ),
        (
            with_adapters({"name": "sql", "uri": "builtin://smollm2-135m-instruct"}),
            "does not match",
            "no adapter is bundled with the engine",
        ),
        (
            with_adapters({"name": "sql", "uri": "s3://bucket/sql"}),
            "does not match",
            "unknown scheme 's3'",
        ),
        (
            with_adapters({"name": "sql", "uri": "hf://org/sql", "targetModules": ["lm_head"]}),
            "is not one of",
            "Input should be 'q_proj'",
        ),
        (
            with_adapters({"name": "sql", "uri": "hf://org/sql", "rank": 32}),
            "an adapter's rank exceeds spec.engine.lora.maxLoraRank",
            f"adapter 'sql' has rank 32, above engine.lora.maxLoraRank {DEFAULT_MAX_LORA_RANK}",
        ),
        (
            with_adapters(
                {"name": "sql", "uri": "hf://org/sql", "rank": 128}, lora={"maxLoraRank": 64}
            ),
            "an adapter's rank exceeds",
            "above engine.lora.maxLoraRank 64",
        ),
        (
            with_adapters(lora={"maxLoras": 4, "maxCpuLoras": 2}),
            "maxCpuLoras cannot be below maxLoras",
            "maxCpuLoras 2 cannot be below maxLoras 4",
        ),
        (
            with_adapters(lora={"maxLoraRank": 1024}),
            "greater than the maximum of 512",
            "less than or equal to 512",
        ),
        # Named like the served model: metadata.name by default, else servedName.
        (
            with_adapters({"name": "chat", "uri": "hf://org/sql"}),
            "may not have the served model's name",
            "adapter 'chat' has the served model's name",
        ),
        (
            {
                **with_adapters({"name": "llama", "uri": "hf://org/sql"}),
                "model": {**MODEL, "servedName": "llama"},
            },
            "may not have the served model's name",
            "adapter 'llama' has the served model's name",
        ),
    ],
)
def test_a_bad_adapter_is_refused_by_the_api_server_and_the_operator(
    spec: dict[str, Any], server_says: str, operator_says: str
) -> None:
    server, operator = refusals(spec)
    assert any(server_says in error for error in server), server
    assert operator is not None and operator_says in operator, operator


def test_good_adapters_pass_both() -> None:
    spec = with_adapters(
        {"name": "sql", "uri": "hf://org/sql@v2", "rank": 64, "targetModules": ["q_proj"]},
        {"name": "Chat.v2_x", "uri": "file:///adapters/chat"},
        {"name": "math", "uri": "pvc://cache/loras/math"},
        lora={"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8},
    )
    spec["model"]["cache"] = {"claimName": "cache"}
    assert refusals(spec) == ([], None)
    # The served name frees the object's own name for an adapter.
    renamed = {**with_adapters({"name": "chat", "uri": "hf://org/sql"})}
    renamed["model"] = {**MODEL, "servedName": "base"}
    assert refusals(renamed) == ([], None)


def test_names_are_unique_for_the_api_server_and_the_operator() -> None:
    adapters = crd_schema(CRD)["properties"]["spec"]["properties"]["adapters"]
    # The API server refuses a repeated key of a map list ("Duplicate value").
    assert adapters["x-kubernetes-list-type"] == "map"
    assert adapters["x-kubernetes-list-map-keys"] == ["name"]
    assert adapters["items"]["required"] == ["name", "uri"]
    spec = with_adapters({"name": "sql", "uri": "hf://org/a"}, {"name": "sql", "uri": "hf://o/b"})
    with pytest.raises(InvalidSpecError, match="names must be unique, repeated: sql"):
        parse_spec(spec)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({}, "no claim is mounted (set spec.model.cache.claimName)"),
        ({"cache": {"claimName": "other"}}, "the model cache mounts the claim 'other'"),
    ],
)
def test_an_adapter_on_a_claim_the_pod_does_not_mount_is_invalid(
    model: dict[str, Any], message: str
) -> None:
    spec = with_adapters({"name": "sql", "uri": "pvc://loras/sql"})
    spec["model"].update(model)
    with pytest.raises(InvalidSpecError, match=r"adapter 'sql': pvc://loras/sql") as caught:
        parse_spec(spec)
    assert message in str(caught.value)


def deployment(spec: dict[str, Any]) -> dict[str, Any]:
    return build_deployment(OWNER, parse_spec(spec), default_image="kvpilot:test", replicas=2)


ADAPTER_SETS = [
    [],
    [{"name": "sql", "uri": "hf://org/sql-lora"}],
    [
        {"name": "sql", "uri": "hf://org/sql-lora@v2", "rank": 8},
        {"name": "chat-v2", "uri": "file:///adapters/chat", "targetModules": ["q_proj"]},
    ],
]


def test_the_pod_template_does_not_depend_on_the_adapters() -> None:
    lora = {"maxLoras": 2, "maxLoraRank": 32}
    built = [deployment(with_adapters(*adapters, lora=lora)) for adapters in ADAPTER_SETS]
    assert built[0] == built[1] == built[2]
    text = json.dumps(built[2])
    assert "sql" not in text and "chat-v2" not in text
    args = built[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    lora_args = args[args.index("--enable-lora") :]
    assert lora_args == [
        "--enable-lora",
        RUNTIME_LORA_FLAG,
        "--max-loras",
        "2",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "2",
    ]


def test_adapters_without_a_lora_block_get_the_default_limits() -> None:
    spec = parse_spec(with_adapters({"name": "sql", "uri": "hf://org/sql"}))
    args = build_engine_args(spec, "chat")
    assert args[args.index("--max-lora-rank") + 1] == str(DEFAULT_MAX_LORA_RANK)
    # And the same pod as an empty lora block gives.
    assert deployment(with_adapters({"name": "sql", "uri": "hf://org/sql"})) == deployment(
        with_adapters(lora={})
    )


def engine_env(spec: dict[str, Any]) -> dict[str, Any]:
    container = deployment(spec)["spec"]["template"]["spec"]["containers"][0]
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container["env"]}


def test_without_lora_the_pod_is_as_before() -> None:
    spec = {"model": dict(MODEL)}
    args = build_engine_args(parse_spec(spec), "chat")
    assert "--enable-lora" not in args and RUNTIME_LORA_FLAG not in args
    env = engine_env(spec)
    assert env["HF_HUB_OFFLINE"] == "1" and "HF_HOME" not in env


def test_with_lora_the_engine_may_fetch_hf_adapters_with_the_models_token() -> None:
    spec = with_adapters(lora={})
    spec["model"]["tokenSecret"] = {"name": "hf", "key": "token"}
    env = engine_env(spec)
    assert "HF_HUB_OFFLINE" not in env
    assert env["HF_HOME"] == "/models/.kvpilot-cache/hf-home"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    # A read-only pvc:// model: downloads go to the writable /tmp volume.
    pvc = {"model": {"uri": "pvc://weights/llama"}, "engine": {"lora": {}}}
    assert engine_env(pvc)["HF_HOME"] == "/tmp/kvpilot-cache/hf-home"


LORA_FLAGS = {"maxLoras": "--max-loras", "maxLoraRank": "--max-lora-rank",
              "maxCpuLoras": "--max-cpu-loras"}  # fmt: skip
# Where the CRD is stricter than the engine on purpose: more slots than it allows adapters.
LORA_STRICTER_THAN_THE_ENGINE = ({"maxLoras": 257}, {"maxLoras": 4, "maxCpuLoras": 1000})


def lora_engine_accepts(lora: dict[str, Any]) -> tuple[bool, str]:
    """`kvpilot serve`'s parser and config on the builder's arguments (or, for a spec the
    operator refuses, the same fields as flags)."""
    try:
        args = build_engine_args(parse_spec(with_adapters(lora=lora)), "chat")[1:]
    except InvalidSpecError:
        args = ["--enable-lora", RUNTIME_LORA_FLAG]
        for field, value in lora.items():
            args += [LORA_FLAGS[field], str(value)]
    try:
        config = engine_config(parse_flags(args))
    except (ValueError, SystemExit) as error:
        return False, str(error)
    assert config.lora is not None and config.lora.allow_runtime_updating
    return True, ""


@pytest.mark.parametrize(
    "lora",
    [
        {},
        {"maxLoras": 0},
        {"maxLoras": 1},
        {"maxLoras": 8},
        {"maxLoras": 257},
        {"maxLoraRank": 0},
        {"maxLoraRank": 1},
        {"maxLoraRank": 512},
        {"maxLoraRank": 513},
        {"maxCpuLoras": 0},
        {"maxCpuLoras": 1},
        {"maxLoras": 4, "maxCpuLoras": 2},
        {"maxLoras": 4, "maxCpuLoras": 4},
        {"maxLoras": 4, "maxCpuLoras": 1000},
        {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 16},
    ],
)
def test_the_crd_admits_exactly_the_lora_limits_the_engine_accepts(lora: dict[str, Any]) -> None:
    server, operator = refusals(with_adapters(lora=lora))
    is_admitted = not server and operator is None
    is_accepted, engine_says = lora_engine_accepts(lora)
    if lora in LORA_STRICTER_THAN_THE_ENGINE:
        assert is_accepted and not is_admitted and operator is not None, (server, operator)
        return
    assert is_admitted == is_accepted, (server, operator, engine_says)
    assert (operator is None) == (not server), (server, operator)  # both refuse, or neither


def test_lora_limits_count_in_the_memory_a_limit_must_hold() -> None:
    """The engine reserves its LoRA slots and host LRU at start (contract/sizing.lora_bytes): a
    limit that cannot hold them is InvalidSpec, as the engine would refuse it."""
    builtin = {"uri": "builtin://smollm2-135m-instruct"}
    resources = {"limits": {"memory": "8Gi"}}
    plain = parse_spec({"model": builtin, "resources": resources})
    assert limit_problem(plain) is None
    small = parse_spec({"model": builtin, "resources": resources, "engine": {"lora": {}}})
    assert limit_problem(small) is None
    assert cpu_memory_need(small) > cpu_memory_need(plain)  # type: ignore[operator]
    big_lora = {"maxLoras": 16, "maxLoraRank": 512, "maxCpuLoras": 64}
    big = parse_spec({"model": builtin, "resources": resources, "engine": {"lora": big_lora}})
    problem = limit_problem(big)
    assert problem is not None and "LoRA adapters" in problem and "engine.lora" in problem
    # Which adapters are listed does not change it: the limits do.
    listed = {"adapters": [{"name": "sql", "uri": "hf://org/sql"}]}
    assert cpu_memory_need(parse_spec({"model": builtin, **listed})) == cpu_memory_need(
        parse_spec({"model": builtin, "engine": {"lora": {}}})
    )
