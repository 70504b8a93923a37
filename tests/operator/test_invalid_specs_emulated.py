"""A table of invalid specs, one per engine field and per rule: each is refused by the API
server's schema or CEL (evaluated here from the generated CRD, as tests/operator/crd_schema.py
does), or admitted there and then answered by the real operator (kopf against kmock) with
Ready=False/InvalidSpec, a Warning Event and no Deployment. The API-server cases go to the
operator too (kmock does not enforce the schema; an older CRD might not either): they get
InvalidSpec the same way, so no spec in the table ever becomes a pod that would crash."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpilot.operator import crdgen

from .conftest import RunningOperator, eventually
from .crd_schema import api_server_errors
from .emulated import (
    DEPLOYMENT,
    condition,
    create_isvc,
    events,
    live,
    status_writes,
)
from .kube_emulator import KubeEmulator

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

CRD = crdgen.build_crd()
BUILTIN = {"uri": "builtin://smollm2-135m-instruct"}
ENOUGH = {"limits": {"memory": "8Gi"}}

# (name, spec fields besides the model, who refuses it: "api" or "operator", words of the reason)
TABLE: list[tuple[str, dict[str, Any], str, str]] = [
    ("block-size-enum", {"engine": {"blockSize": 24}}, "api", "blockSize"),
    ("block-size-big", {"engine": {"blockSize": 256}}, "api", "blockSize"),
    ("max-model-len", {"engine": {"maxModelLen": 0}}, "api", "maxModelLen"),
    ("max-num-seqs", {"engine": {"maxNumSeqs": 0}}, "api", "maxNumSeqs"),
    ("max-batched", {"engine": {"maxNumBatchedTokens": -1}}, "api", "maxNumBatchedTokens"),
    # Strict on both sides: "yes" is no boolean (the operator's model would once read it as true).
    ("prefix-caching-type", {"engine": {"enablePrefixCaching": "yes"}}, "api",
     "enablePrefixCaching"),
    ("max-num-seqs-type", {"engine": {"maxNumSeqs": "8"}}, "api", "maxNumSeqs"),
    ("dtype-enum", {"engine": {"dtype": "int8"}}, "api", "dtype"),
    ("dtype-fp16-on-cpu", {"engine": {"dtype": "float16"}}, "api", "needs a GPU"),
    ("gpu-util", {"engine": {"gpuMemoryUtilization": 1.2}}, "api", "gpuMemoryUtilization"),
    ("kv-bytes-pattern", {"engine": {"kvCacheBytes": "lots"}}, "api", "kvCacheBytes"),
    ("kv-bytes-tiny", {"engine": {"kvCacheBytes": "64Ki"}}, "operator", "below 1Mi"),
    ("kv-fraction-range", {"engine": {"kvCacheMemoryFraction": 1.0}, "resources": ENOUGH},
     "api", "kvCacheMemoryFraction"),
    ("kv-fraction-no-limit", {"engine": {"kvCacheMemoryFraction": 0.5}}, "api",
     "needs resources.limits.memory"),
    ("kv-fraction-tiny", {"engine": {"kvCacheMemoryFraction": 1e-7}, "resources": ENOUGH},
     "operator", "below 1Mi"),
    ("kv-both", {"engine": {"kvCacheBytes": "1Gi", "kvCacheMemoryFraction": 0.2},
                 "resources": ENOUGH}, "api", "mutually exclusive"),
    ("api-key-secret-name", {"engine": {"apiKeySecret": {"key": "k"}}}, "api", "apiKeySecret"),
    ("api-key-twice", {"engine": {"apiKeySecret": {"name": "s"},
                                  "env": [{"name": "KVPILOT_API_KEY", "value": "x"}]}},
     "operator", "KVPILOT_API_KEY"),
    ("extra-args-reserved", {"engine": {"extraArgs": ["--port=1"]}}, "operator", "--port"),
    # extraArgs read by `kvpilot serve`'s own parser: what it refuses, and what the spec sets.
    ("extra-args-unknown", {"engine": {"extraArgs": ["--swap-space=4"]}}, "operator",
     "unrecognized arguments: --swap-space=4"),
    ("extra-args-bad-int", {"engine": {"extraArgs": ["--max-queue", "many"]}}, "operator",
     "argument --max-queue: invalid int value: 'many'"),
    ("extra-args-bad-choice", {"engine": {"extraArgs": ["--attention-backend=gpu"]}}, "operator",
     "argument --attention-backend: invalid choice: 'gpu'"),
    ("extra-args-no-value", {"engine": {"extraArgs": ["--seed"]}}, "operator",
     "argument --seed: expected one argument"),
    ("extra-args-limit", {"engine": {"extraArgs": ["--max-json-depth=0"]}}, "operator",
     "max_json_depth must be >= 1"),
    ("extra-args-help", {"engine": {"extraArgs": ["--help"]}}, "operator", "print its help"),
    ("extra-args-spec-field", {"engine": {"extraArgs": ["--max-num-seqs", "8"]}}, "operator",
     "extraArgs may not set --max-num-seqs: set spec.engine.maxNumSeqs"),
    ("extra-args-alias", {"engine": {"extraArgs": ["-tp", "2"]}}, "operator",
     "extraArgs may not set --tensor-parallel-size"),
    ("extra-args-api-key", {"engine": {"extraArgs": ["--api-key", "s3cret"]}}, "operator",
     "use spec.engine.apiKeySecret"),
    ("extra-args-api-key-file", {"engine": {"extraArgs": ["--api-key-file", "/k"]}}, "operator",
     "extraArgs may not set --api-key-file: the operator hands the engine its key from "
     "spec.engine.apiKeySecret"),
    # Values the engine's settings refuse after parsing (the same rules `kvpilot serve` applies).
    ("extra-args-max-queue", {"engine": {"extraArgs": ["--max-queue", "-1"]}}, "operator",
     "max_queue must be >= 0, got -1"),
    ("extra-args-retry-after", {"engine": {"extraArgs": ["--retry-after=0"]}}, "operator",
     "retry_after_s must be >= 1, got 0"),
    ("extra-args-timeout-nan", {"engine": {"extraArgs": ["--distributed-timeout=nan"]}},
     "operator", "distributed_timeout_s must be > 0 and finite, got nan"),
    ("extra-args-kv-gib", {"engine": {"extraArgs": ["--kv-cache-gib", "64"]}}, "operator",
     "extraArgs may not set --kv-cache-gib: set spec.engine.kvCacheBytes"),
    ("extra-args-device-name", {"engine": {"extraArgs": ["--device", "gpu"]}}, "operator",
     "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    # The pod gets no GPU (spec.gpus 0): the engine would refuse --device cuda at start.
    ("extra-args-cuda-on-cpu", {"engine": {"extraArgs": ["--device", "cuda"]}}, "operator",
     "in a pod with 0 GPU(s) (spec.gpus): device cuda needs a GPU, but none is visible"),
    ("image-empty", {"engine": {"image": ""}}, "api", "image"),
    ("startup-timeout", {"engine": {"startupTimeoutSeconds": 1}}, "api", "startupTimeoutSeconds"),
    ("memory-limit-below-need", {"resources": {"limits": {"memory": "1Gi"}}}, "operator",
     "below what the engine needs"),
    ("memory-limit-below-kv", {"engine": {"kvCacheBytes": "4Gi"},
                               "resources": {"limits": {"memory": "4Gi"}}}, "operator",
     "below what the engine needs"),
    # LoRA adapters: refused before any pod sees them.
    ("adapter-name", {"adapters": [{"name": "-sql", "uri": "hf://o/a"}]}, "api", "name"),
    ("adapter-builtin", {"adapters": [{"name": "sql", "uri": BUILTIN["uri"]}]}, "api", "uri"),
    ("adapter-target", {"adapters": [{"name": "sql", "uri": "hf://o/a",
                                      "targetModules": ["lm_head"]}]}, "api", "targetModules"),
    ("adapter-rank", {"adapters": [{"name": "sql", "uri": "hf://o/a", "rank": 64}]}, "api",
     "an adapter's rank exceeds spec.engine.lora.maxLoraRank"),
    ("adapter-served-name", {"adapters": [{"name": "adapter-served-name", "uri": "hf://o/a"}]},
     "api", "may not have the served model's name"),
    ("adapter-claim", {"adapters": [{"name": "sql", "uri": "pvc://loras/sql"}]}, "operator",
     "adapters on a claim must be on the model cache's"),
    ("lora-cpu-below-slots", {"engine": {"lora": {"maxLoras": 4, "maxCpuLoras": 2}}}, "api",
     "maxCpuLoras cannot be below maxLoras"),
    ("extra-args-lora-modules", {"engine": {"extraArgs": ["--lora-modules", "sql=/a"]}},
     "operator", "list them in spec.adapters"),
]  # fmt: skip


def full(fields: dict[str, Any]) -> dict[str, Any]:
    return {"model": BUILTIN, **fields}


def isvc(name: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "serving"},
        "spec": full(fields),
    }


@pytest.mark.parametrize(("name", "fields", "who", "words"), TABLE, ids=[t[0] for t in TABLE])
def test_the_api_server_refuses_exactly_the_api_cases(
    name: str, fields: dict[str, Any], who: str, words: str
) -> None:
    errors = api_server_errors(CRD, isvc(name, fields))
    if who == "api":
        assert errors and any(words in e for e in errors), errors
    else:
        assert errors == []


async def test_every_invalid_spec_is_invalidspec_without_a_deployment(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    for name, fields, _, _ in TABLE:
        await create_isvc(kmock, name, full(fields))
    await create_isvc(kmock, "fine", {"model": BUILTIN, "resources": ENOUGH})
    await eventually(lambda: live(kmock, DEPLOYMENT, "fine"), timeout=60)
    for name, _, who, words in TABLE:
        await eventually(lambda n=name: (condition(kmock, n, "Ready") or ("",))[0] == "False")
        _status, reason, message = condition(kmock, name, "Ready")  # type: ignore[misc]
        assert reason == "InvalidSpec", (name, message)
        if who == "operator":
            assert words in message, (name, message)
        assert "s3cret" not in message
        await eventually(
            lambda n=name: any(
                e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events(kmock, n)
            )
        )
    writes = {name: status_writes(kmock, name) for name, *_ in TABLE}
    await asyncio.sleep(2 * operator.config.resync_seconds)
    for name, *_ in TABLE:
        assert not any("s3cret" in e["message"] for e in events(kmock, name)), name
        assert live(kmock, DEPLOYMENT, name) is None, name
        assert status_writes(kmock, name) == writes[name], name  # no retry storm
        assert [e["reason"] for e in events(kmock, name)].count("InvalidSpec") == 1, name


async def test_a_request_below_the_need_is_a_warning_condition_not_a_refusal(
    kmock: KubeEmulator, operator: RunningOperator
) -> None:
    low = {"requests": {"memory": "1Gi"}, "limits": {"memory": "8Gi"}}
    await create_isvc(kmock, "low", {"model": BUILTIN, "resources": low})
    await eventually(lambda: live(kmock, DEPLOYMENT, "low"))
    await eventually(lambda: condition(kmock, "low", "MemorySufficient"))
    status, reason, message = condition(kmock, "low", "MemorySufficient")  # type: ignore[misc]
    assert (status, reason) == ("False", "MemoryRequestBelowNeed")
    assert "requests.memory (1.00 GiB)" in message
    await eventually(
        lambda: any(e["reason"] == "MemoryRequestBelowNeed" for e in events(kmock, "low"))
    )
    await create_isvc(kmock, "fine", {"model": BUILTIN, "resources": {"limits": ENOUGH["limits"]}})
    await eventually(lambda: condition(kmock, "fine", "Ready"))
    assert condition(kmock, "fine", "MemorySufficient") is None  # only where it matters
