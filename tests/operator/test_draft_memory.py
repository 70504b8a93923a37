"""A speculative draft model in the operator's memory estimate: `--speculative-config` in
extraArgs with a builtin draft adds its weights and its own KV pool (contract/sizing.py, the
engine's rule: tests/operator/test_engine_agreement.py holds the two equal); a draft whose shape
the operator cannot know leaves the check to the engine, and n-gram speculation holds nothing."""

from __future__ import annotations

import json
from typing import Any

from kvpilot.operator.builtin_models import BUILTIN_MODELS
from kvpilot.operator.memory import cpu_memory_need, limit_problem
from kvpilot.operator.spec import InferenceServiceSpec, parse_spec

BUILTIN = "builtin://smollm2-135m-instruct"
SMOLLM2 = BUILTIN_MODELS["smollm2-135m-instruct"]
# float32 (auto on CPU): K and V of one token over 30 layers of 3 KV heads of 64.
PER_TOKEN = 2 * 30 * 3 * 64 * 4


def isvc(speculative: dict[str, Any] | None, **engine: Any) -> InferenceServiceSpec:
    if speculative is not None:
        engine["extraArgs"] = ["--speculative-config", json.dumps(speculative)]
    return parse_spec(
        {"model": {"uri": BUILTIN}, "resources": {"limits": {"memory": "4Gi"}}, "engine": engine}
    )


def draft_bytes(speculative: dict[str, Any], **engine: Any) -> int:
    need, without = (
        cpu_memory_need(isvc(speculative, **engine)),
        cpu_memory_need(isvc(None, **engine)),
    )
    assert need is not None and without is not None
    return need - without


def test_a_builtin_draft_adds_its_weights_and_a_kv_pool_as_large_as_the_targets() -> None:
    # The default 1 GiB budget holds 1456 blocks of 16 tokens; 8 sequences of 8192 are more.
    assert draft_bytes({"model": BUILTIN}) == SMOLLM2.num_params * 4 + 1456 * 16 * PER_TOKEN


def test_a_draft_pool_of_disable_by_batch_size_longest_sequences_where_fewer() -> None:
    # 2 sequences of 1000 tokens: 63 blocks of 32; the FP8 target cache does not change the
    # draft's, which is in the model's dtype.
    spec = {"model": BUILTIN, "disable_by_batch_size": 2}
    got = draft_bytes(spec, maxModelLen=1000, blockSize=32, kvCacheDtype="fp8")
    assert got == SMOLLM2.num_params * 4 + 63 * 32 * PER_TOKEN


def test_a_limit_that_holds_the_target_alone_is_refused_with_a_draft() -> None:
    assert limit_problem(isvc(None)) is None
    problem = limit_problem(isvc({"model": BUILTIN}))
    assert problem is not None and "resources.limits.memory (4.00 GiB)" in problem


def test_ngram_adds_nothing_and_an_unknown_draft_is_left_to_the_engine() -> None:
    assert draft_bytes({"method": "ngram", "num_speculative_tokens": 3}) == 0
    assert cpu_memory_need(isvc({"model": "/models/draft"})) is None
    assert limit_problem(isvc({"model": "/models/draft"})) is None
