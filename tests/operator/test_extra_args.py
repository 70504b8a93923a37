"""spec.engine.extraArgs checked with `kvpilot serve`'s own argument parser (operator/extraargs.py):
what the engine would refuse at start is InvalidSpec, and so is an option the operator sets."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.engine.server.flags import build_parser, parse_flags
from kvpilot.operator.builders import build_engine_args
from kvpilot.operator.extraargs import SET_BY_THE_OPERATOR
from kvpilot.operator.spec import InvalidSpecError, parse_spec

MODEL = {"uri": "builtin://smollm2-135m-instruct"}
REFUSED = "spec.engine.extraArgs: `kvpilot serve` would refuse them: "


def with_extra(args: list[str], **engine: Any) -> dict[str, Any]:
    return {"model": MODEL, "engine": {**engine, "extraArgs": args}}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--enforce-eager"], "unrecognized arguments: --enforce-eager"),
        (["--max-queue", "many"], "argument --max-queue: invalid int value: 'many'"),
        (
            ["--attention-backend=gpu"],
            "argument --attention-backend: invalid choice: 'gpu' "
            "(choose from 'auto', 'torch', 'cpu', 'triton')",
        ),
        (["--seed"], "argument --seed: expected one argument"),
        (["--max-json-depth", "0"], "max_json_depth must be >= 1, got 0"),
        (["-h"], "-h/--help makes `kvpilot serve` print its help and exit"),
        (["--seed", "1", "2"], "unrecognized arguments: 2"),
    ],
)
def test_what_the_engine_refuses_is_invalid_spec(args: list[str], message: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(with_extra(args))
    assert str(caught.value) == REFUSED + message


@pytest.mark.parametrize(
    ("args", "flag", "instead"),
    [
        (["--port=1"], "--port", "the engine must listen on 0.0.0.0:8000"),
        (["--po", "1"], "--port", "the engine must listen on 0.0.0.0:8000"),  # abbreviated
        (["--model", "/x"], "--model", "spec.model.uri"),
        (["-tp", "2"], "--tensor-parallel-size", "spec.engine.tensorParallelSize"),
        (["--guided-decoding-backend", "xgrammar"], "--structured-outputs-backend",
         "spec.engine.structuredOutputsBackend"),
        (["--no-enable-prefix-caching"], "--enable-prefix-caching",
         "spec.engine.enablePrefixCaching"),
        (["--max-num-seqs", "128"], "--max-num-seqs", "spec.engine.maxNumSeqs"),  # the default
        (["--shutdown-timeout=5"], "--shutdown-timeout", "spec.drainSeconds"),
        (["--seed", "1", "--kv-cache-memory-bytes", "1"], "--kv-cache-memory-bytes",
         "spec.engine.kvCacheBytes"),
    ],
)  # fmt: skip
def test_an_option_the_operator_sets_is_refused_however_written(
    args: list[str], flag: str, instead: str
) -> None:
    with pytest.raises(InvalidSpecError, match=f"extraArgs may not set {flag}: .*{instead}"):
        parse_spec(with_extra(args))


def test_an_api_key_in_the_arguments_is_refused_without_repeating_it() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(with_extra(["--api-key", "s3cret"]))
    assert "spec.engine.apiKeySecret" in str(caught.value)
    assert "s3cret" not in str(caught.value)


def test_arguments_the_engine_takes_pass_and_come_last() -> None:
    args = ["--seed", "7", "--max-queue=64", "--attention-backend", "cpu", "--max-json-depth", "16"]
    spec = parse_spec(with_extra(args))
    command = build_engine_args(spec, "chat")
    assert command[-len(args) :] == args
    parsed = parse_flags(command[1:])  # the pod's whole command line, as the engine reads it
    assert (parsed.seed, parsed.max_queue, parsed.max_json_depth) == (7, 64, 16)


EVERY_FIELD = {
    "blockSize": 32, "maxModelLen": 2048, "maxNumSeqs": 8, "maxNumBatchedTokens": 512,
    "enablePrefixCaching": False, "dtype": "bfloat16", "gpuMemoryUtilization": 0.8,
    "kvCacheBytes": "1Gi", "tensorParallelSize": 2, "structuredOutputsBackend": "xgrammar",
    "toolCallParser": "hermes", "chatTemplate": "{{ messages }}",
}  # fmt: skip


def test_every_option_the_builder_sets_is_reserved() -> None:
    spec = parse_spec({"model": {"uri": "hf://org/model"}, "gpus": 2, "engine": EVERY_FIELD})
    set_by_builder = vars(parse_flags(build_engine_args(spec, "chat")[1:], only_given=True))
    assert set(set_by_builder) <= set(SET_BY_THE_OPERATOR), set(set_by_builder)
    # Each entry names the parser's own flag for that option.
    flags = {action.dest: action.option_strings for action in build_parser()._actions}
    for dest, (flag, _) in SET_BY_THE_OPERATOR.items():
        assert flag in flags[dest], (dest, flag)
