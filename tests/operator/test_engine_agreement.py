"""One validation for every engine setting: what the CRD admits (OpenAPI schema + CEL, as the API
server checks it) and the operator's spec model accept, the engine accepts too, and the other
way round.

Every property of spec.engine in the generated CRD must be listed below, either as an engine
setting (probed with boundary values on both sides) or as a container setting the engine never
sees; a new field fails the first test until it is classified. The engine side is the engine's
own code: `kvpilot serve`'s argument parser on the arguments the operator's builder produces, then
the engine's config validation (EngineConfig and its parts validate at construction, dtype against
the device the pod gets).
"""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any

import pytest
from kubernetes.utils import parse_quantity

from kvpilot.contract.engine_choices import BLOCK_SIZES, DTYPE_NAMES
from kvpilot.engine.model.loader import peek_model_config
from kvpilot.engine.parallel.sharding import check_tensor_parallel_size
from kvpilot.engine.server.cli import build_parser, engine_config
from kvpilot.operator import crdgen
from kvpilot.operator.builders import build_engine_args
from kvpilot.operator.builtin_models import BUILTIN_MODELS, ModelShape
from kvpilot.operator.spec import InvalidSpecError, parse_spec

from .crd_schema import api_server_errors, crd_schema

CRD = crdgen.build_crd()
BUILTIN = {"uri": "builtin://smollm2-135m-instruct"}
INTS = [-1, 0, 1, 2, 7, 8, 9, 15, 16, 17, 32, 64, 100, 128, 129, 256, 1024, 2048, 10**6]
FLOATS = [-0.5, 0.0, 1e-6, 0.05, 0.5, 0.9, 1.0, 1.0001, 1.5]
QUANTITIES = ["0", "1", "1023Ki", "1Mi", "768Mi", "2Gi", "1.5Gi", 2**20, 12345678]

# CRD field -> the values to probe on both sides.
ENGINE_SETTINGS: dict[str, list[Any]] = {
    "blockSize": INTS,
    "maxModelLen": INTS,
    "maxNumSeqs": INTS,
    "maxNumBatchedTokens": INTS,
    # A string or a number is no boolean: the CRD refuses it, so must the operator's model
    # (a lax one would read "yes" as true); the engine's flag takes no value at all.
    "enablePrefixCaching": [True, False, "yes", "false", 1],
    "dtype": ["auto", *DTYPE_NAMES, "int8", "fp8", "Float32"],
    "kvCacheDtype": ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "FP8", ""],
    "gpuMemoryUtilization": FLOATS,
    "kvCacheBytes": QUANTITIES,
    "kvCacheMemoryFraction": FLOATS,
    "tensorParallelSize": [-1, 0, 1, 2, 3, 4, 9, 64, 65],
    "structuredOutputsBackend": ["auto", "xgrammar", "llguidance", "outlines", "XGrammar", ""],
    "toolCallParser": ["hermes", "llama3_json", "mistral", "pythonic", ""],
    "chatTemplate": ["{{ messages[0].content }}", ""],
    "schedulingPolicy": ["fcfs", "priority", "FCFS", "lottery", ""],
}
# Settings of the container, not of the engine's configuration (their own tests cover them).
CONTAINER_SETTINGS = {
    "image",
    "imagePullPolicy",
    "env",
    "extraArgs",
    "startupTimeoutSeconds",
    "apiKeySecret",
}
# Engine settings of several fields, probed both ways in a test of their own: field -> where.
PROBED_ELSEWHERE = {"lora": "test_adapters_spec.py"}
# Where the CRD or the operator is stricter than the engine's config on purpose, because the
# engine's own limit needs the model: a KV budget below one block (the engine would accept the
# flag and fail at load), or a KV fraction that leaves nothing of the memory limit for the weights
# (the engine's start-up memory check would refuse it). Value: who refuses.
STRICTER_THAN_THE_ENGINE = {
    ("kvCacheBytes", "1"): "InvalidSpec",
    ("kvCacheBytes", "1023Ki"): "InvalidSpec",
    ("kvCacheMemoryFraction", 1e-6): "InvalidSpec",  # 4 KiB of a 4Gi limit
    ("kvCacheMemoryFraction", 1.0): "API server",
    ("kvCacheMemoryFraction", 1.0001): "API server",
    ("kvCacheMemoryFraction", 1.5): "API server",
}


def engine_properties() -> set[str]:
    spec = crd_schema(CRD)["properties"]["spec"]
    return set(spec["properties"]["engine"]["properties"])


def test_every_engine_field_of_the_crd_is_classified() -> None:
    classified = set(ENGINE_SETTINGS) | CONTAINER_SETTINGS | set(PROBED_ELSEWHERE)
    assert engine_properties() == classified


def admitted(spec: dict[str, Any]) -> tuple[bool, str]:
    """API server (schema + CEL) and the operator's model; the reason when refused."""
    obj = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "serving"},
        "spec": spec,
    }
    errors = api_server_errors(CRD, obj)
    if errors:
        return False, f"API server: {errors}"
    try:
        parse_spec(spec)
    except InvalidSpecError as error:
        return False, f"InvalidSpec: {error}"
    return True, ""


def engine_accepts(spec: dict[str, Any], on_gpu: bool) -> tuple[bool, str]:
    """The engine's verdict on the arguments the operator would give it (in a pod with or
    without a GPU). Needs a spec the operator's model parses: the builder works from it; for one
    the model refuses, the raw engine fields are turned into flags the same way."""
    try:
        args = build_engine_args(parse_spec(spec), "chat")[1:]  # drop the "serve" subcommand
    except InvalidSpecError:
        args = raw_engine_args(spec)
    if on_gpu:
        args += ["--device", "cuda"]
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            parsed = build_parser().parse_args(args)
    except SystemExit:
        return False, f"argparse: {err.getvalue().strip()}"
    try:
        config = engine_config(parsed)
        config.resolved_dtype  # noqa: B018 - float16 on CPU raises here
        if config.tensor_parallel_size > 1:  # what `kvpilot serve` checks before any process
            check_tensor_parallel_size(
                model_shape(config.model),
                config.tensor_parallel_size,
                num_gpus=spec.get("gpus", 0) if on_gpu else None,
            )
    except ValueError as error:
        return False, f"config: {error}"
    return True, ""


@functools.cache
def model_shape(model: str | None) -> Any:
    """The engine's own reading of the model's config (cached: it parses the GGUF header)."""
    return peek_model_config(model)


FLAGS = {
    "blockSize": "--block-size",
    "maxModelLen": "--max-model-len",
    "maxNumSeqs": "--max-num-seqs",
    "maxNumBatchedTokens": "--max-num-batched-tokens",
    "dtype": "--dtype",
    "kvCacheDtype": "--kv-cache-dtype",
    "gpuMemoryUtilization": "--gpu-memory-utilization",
    "tensorParallelSize": "--tensor-parallel-size",
    "structuredOutputsBackend": "--structured-outputs-backend",
    "toolCallParser": "--tool-call-parser",
    "chatTemplate": "--chat-template",
    "schedulingPolicy": "--scheduling-policy",
}


def raw_engine_args(spec: dict[str, Any]) -> list[str]:
    engine = spec.get("engine", {})
    args: list[str] = []
    for field, value in engine.items():
        if field in FLAGS:
            args += [FLAGS[field], str(value)]
        elif field == "enablePrefixCaching":
            if isinstance(value, bool):
                args.append("--enable-prefix-caching" if value else "--no-enable-prefix-caching")
            else:
                args.append(f"--enable-prefix-caching={value}")  # argparse: no value allowed
        elif field == "kvCacheBytes":
            with contextlib.suppress(ValueError):
                args += ["--kv-cache-memory-bytes", str(int(parse_quantity(value)))]
        elif field == "kvCacheMemoryFraction":
            limit = spec.get("resources", {}).get("limits", {}).get("memory")
            if isinstance(value, float) and limit is not None:
                args += ["--kv-cache-memory-bytes", str(int(value * float(parse_quantity(limit))))]
            else:
                args += ["--kv-cache-memory-bytes", "not-a-number"]
    return args


CASES = [
    (field, value, gpus)
    for field, values in ENGINE_SETTINGS.items()
    for value in values
    for gpus in (0, 1)
]


@pytest.mark.parametrize(("field", "value", "gpus"), CASES)
def test_the_crd_admits_exactly_what_the_engine_accepts(field: str, value: Any, gpus: int) -> None:
    spec: dict[str, Any] = {"model": BUILTIN, "engine": {field: value}, "gpus": gpus}
    if field == "kvCacheMemoryFraction":
        spec["resources"] = {"limits": {"memory": "4Gi"}}
    is_admitted, why_not = admitted(spec)
    is_accepted, engine_says = engine_accepts(spec, on_gpu=gpus > 0)
    if (field, value) in STRICTER_THAN_THE_ENGINE:
        assert is_accepted, engine_says  # else the entry is not needed
        assert not is_admitted and why_not.startswith(STRICTER_THAN_THE_ENGINE[field, value])
        return
    assert is_admitted == is_accepted, (why_not, engine_says)


def test_the_probes_reach_both_verdicts_for_every_field() -> None:
    """The table is only worth something if each field has values on both sides."""
    for field, values in ENGINE_SETTINGS.items():
        verdicts = set()
        for value in values:
            spec: dict[str, Any] = {"model": BUILTIN, "engine": {field: value}}
            if field == "kvCacheMemoryFraction":
                spec["resources"] = {"limits": {"memory": "4Gi"}}
            verdicts.add(admitted(spec)[0])
        assert verdicts == {True, False}, field


# Values of another JSON type than the CRD's, which a lax model would coerce ("yes" -> true,
# "8" -> 8, true -> 1, "0.5" -> 0.5).
WRONG_TYPES: dict[str, list[Any]] = {
    "boolean": ["yes", "true", 1, 0],
    "integer": ["8", True, 8.5],
    "number": ["0.5", True],
    "string": [8, True],
}
TYPED = [
    (field, value)
    for field, node in sorted(
        crd_schema(CRD)["properties"]["spec"]["properties"]["engine"]["properties"].items()
    )
    for value in WRONG_TYPES.get(node.get("type", ""), [])
]


@pytest.mark.parametrize(("field", "value"), TYPED)
def test_a_value_of_the_wrong_type_is_refused_on_both_sides(field: str, value: Any) -> None:
    spec: dict[str, Any] = {"model": BUILTIN, "engine": {field: value}}
    errors = api_server_errors(CRD, {"apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService", "metadata": {"name": "chat", "namespace": "serving"},
        "spec": spec})  # fmt: skip
    assert errors, "the API server admits it"
    with pytest.raises(InvalidSpecError, match=f"spec.engine.{field}: Input should be"):
        parse_spec(spec)


def test_every_typed_engine_field_is_probed_with_wrong_types() -> None:
    probed = {field for field, _ in TYPED}
    node = crd_schema(CRD)["properties"]["spec"]["properties"]["engine"]["properties"]
    scalars = {f for f, n in node.items() if n.get("type") in WRONG_TYPES}
    assert probed == scalars and "enablePrefixCaching" in probed


def test_block_sizes_come_from_the_engine() -> None:
    node = crd_schema(CRD)["properties"]["spec"]["properties"]["engine"]["properties"]
    assert tuple(node["blockSize"]["enum"]) == BLOCK_SIZES
    assert set(node["dtype"]["enum"]) == {"auto", *DTYPE_NAMES}


DRAFT_SPEC = '{"model": "builtin://smollm2-135m-instruct", "num_speculative_tokens": 3}'


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"dtype": "bfloat16", "kvCacheBytes": "768Mi", "maxNumSeqs": 8},
        {"dtype": "float32", "maxNumBatchedTokens": 512, "blockSize": 32},
        {"lora": {}},
        {"dtype": "bfloat16", "lora": {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 16}},
        # A builtin draft model: its weights and its own KV pool, by the target's pool...
        {"extraArgs": ["--speculative-config", DRAFT_SPEC]},
        # ...or by disable_by_batch_size sequences of maxModelLen, under an FP8 target cache.
        {
            "kvCacheDtype": "fp8",
            "maxModelLen": 1000,
            "blockSize": 32,
            "extraArgs": [
                "--speculative-config",
                '{"model": "builtin://smollm2-135m-instruct", "disable_by_batch_size": 3}',
            ],
        },
        # n-gram speculation holds no model.
        {"extraArgs": ["--speculative-config", '{"method": "ngram"}']},
    ],
)
def test_the_operator_predicts_the_memory_the_engine_checks(engine: dict[str, Any]) -> None:
    """The operator's need for the builtin model (its shape table, the contract's defaults and
    dtype sizes) equals the engine's start-up check on the bundled model's real config, for the
    flags the builder gives it (the same arithmetic, contract/sizing.py, on both sides)."""
    from kvpilot.engine.config import ModelConfig
    from kvpilot.engine.core.engine_core import cpu_memory_need
    from kvpilot.engine.model.loader import read_hf_config, resolve_model
    from kvpilot.operator import memory

    spec = parse_spec({"model": BUILTIN, "engine": engine})
    parsed = build_parser().parse_args(build_engine_args(spec, "chat")[1:])
    model = ModelConfig.from_hf_config(read_hf_config(resolve_model(None, "auto").hf_dir))
    assert memory.cpu_memory_need(spec) == cpu_memory_need(engine_config(parsed), model).total


def test_the_builtin_models_shapes_are_the_bundled_models() -> None:
    """The operator's table of builtin models holds the engine's own reading of its bundled
    model (the one `kvpilot serve` loads without --model)."""
    model = model_shape(None)
    assert {
        "smollm2-135m-instruct": ModelShape(
            num_params=model.num_params,
            num_layers=model.num_hidden_layers,
            num_heads=model.num_attention_heads,
            num_kv_heads=model.num_key_value_heads,
            head_dim=model.head_dim,
            hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size,
            vocab_size=model.vocab_size,
            max_position_embeddings=model.max_position_embeddings,
        )
    } == BUILTIN_MODELS
