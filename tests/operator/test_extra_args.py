"""spec.engine.extraArgs checked with `kvpilot serve`'s own argument parser (operator/extraargs.py):
what the engine would refuse at start is InvalidSpec, and so is an option the operator sets."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.contract.engine_flags import build_parser, read_flags
from kvpilot.engine.server.cli import main
from kvpilot.engine.server.from_flags import parse_flags
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
        (["--swap-space=4"], "unrecognized arguments: --swap-space=4"),
        (["--max-queue", "many"], "argument --max-queue: invalid int value: 'many'"),
        (
            ["--attention-backend=gpu"],
            "argument --attention-backend: invalid choice: 'gpu' "
            "(choose from 'auto', 'torch', 'cpu', 'triton')",
        ),
        (["--seed"], "argument --seed: expected one argument"),
        (["--max-json-depth", "0"], "max_json_depth must be >= 1, got 0"),
        # Refused by the engine's settings after parsing: the same rules, the same words.
        (["--max-queue", "-1"], "max_queue must be >= 0, got -1"),
        (["--retry-after=0"], "retry_after_s must be >= 1, got 0"),
        (["--max-tokens-limit", "0"], "max_tokens must be >= 1, got 0"),
        (["--distributed-timeout", "nan"], "distributed_timeout_s must be > 0 and finite, got nan"),
        (["--distributed-timeout", "-1"], "distributed_timeout_s must be > 0 and finite, got -1.0"),
        (["--seed", str(2**64)], "seed must be in [-2**63, 2**64), got 18446744073709551616"),
        (["--device", "gpu"], "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
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
        # The KV budget the memory check adds up: the spec's alone.
        (["--kv-cache-gib", "6"], "--kv-cache-gib", "spec.engine.kvCacheBytes"),
        (["--num-gpu-blocks-override=4"], "--num-gpu-blocks-override",
         "spec.engine.kvCacheBytes"),
        (["--api-key-file", "/k"], "--api-key-file", "spec.engine.apiKeySecret"),
    ],
)  # fmt: skip
def test_an_option_the_operator_sets_is_refused_however_written(
    args: list[str], flag: str, instead: str
) -> None:
    with pytest.raises(InvalidSpecError, match=f"extraArgs may not set {flag}: .*{instead}"):
        parse_spec(with_extra(args))


@pytest.mark.parametrize(
    "args",
    [
        ["--max-queue", "-1"],
        ["--retry-after", "0"],
        ["--distributed-timeout=0"],
        ["--device", "npu"],
    ],
)
def test_the_operator_gives_the_words_kvpilot_serve_prints(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2  # the command itself, in this process: it stops before the engine
    printed = capsys.readouterr().err.strip().splitlines()[-1].removeprefix("kvpilot serve: ")
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(with_extra(args))
    assert str(caught.value) == REFUSED + printed


def on_gpus(args: list[str], gpus: int, **engine: Any) -> dict[str, Any]:
    # A model of unknown shape: only the GPUs decide (builtin models' shapes are checked too).
    return {"model": {"uri": "hf://org/model"}, "gpus": gpus,
            "engine": {**engine, "extraArgs": args}}  # fmt: skip


@pytest.mark.parametrize(
    ("args", "gpus", "engine", "message"),
    [
        (["--device", "cuda"], 0, {}, "device cuda needs a GPU, but none is visible: use cpu"),
        (["--device=cuda:0"], 0, {}, "device cuda:0 needs a GPU, but none is visible: use cpu"),
        (["--device", "cuda:1"], 1, {}, "device cuda:1 needs GPU 1, but 1 are visible"),
        # spec.gpus 2 makes the engine split over 2 ranks, from GPU 1 on: one is missing.
        (["--device", "cuda:1"], 2, {},
         "tensor_parallel_size 2 needs 2 GPUs, but 1 are visible from cuda:1 on"),
        (["--device", "cpu"], 1, {"dtype": "float16"},
         "dtype float16 is not supported on CPU: use float32 or bfloat16"),
    ],
)  # fmt: skip
def test_a_device_the_pods_gpus_cannot_serve_is_invalid_spec(
    args: list[str], gpus: int, engine: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(on_gpus(args, gpus, **engine))
    assert str(caught.value) == (
        f"spec: engine.extraArgs: `kvpilot serve` would refuse them in a pod with {gpus} GPU(s) "
        f"(spec.gpus): {message}"
    )


@pytest.mark.parametrize(
    ("args", "gpus", "engine"),
    [
        (["--device", "cuda"], 1, {}),
        (["--device", "cuda:1"], 2, {"tensorParallelSize": 1}),
        (["--device", "cpu"], 0, {}),
        (["--device", "cpu"], 1, {"dtype": "bfloat16"}),  # a GPU left idle is no crash
    ],
)
def test_a_device_the_pod_has_is_admitted(
    args: list[str], gpus: int, engine: dict[str, Any]
) -> None:
    spec = parse_spec(on_gpus(args, gpus, **engine))
    assert build_engine_args(spec, "chat")[-len(args) :] == args


def test_the_api_key_file_is_the_operators_to_set() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(with_extra(["--api-key-file", "/var/run/key"]))
    assert str(caught.value) == (
        "spec.engine.extraArgs: extraArgs may not set --api-key-file: the operator hands the "
        "engine its key from spec.engine.apiKeySecret (a Secret)"
    )
    with pytest.raises(InvalidSpecError, match="may not set --api-key-file"):
        parse_spec(with_extra(["--api-key-f=/k"]))  # abbreviated


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
    "lora": {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 4},
}  # fmt: skip


def test_every_option_the_builder_sets_is_reserved() -> None:
    spec = parse_spec({"model": {"uri": "hf://org/model"}, "gpus": 2, "engine": EVERY_FIELD})
    set_by_builder = vars(read_flags(build_engine_args(spec, "chat")[1:], only_given=True))
    assert set(set_by_builder) <= set(SET_BY_THE_OPERATOR), set(set_by_builder)
    # Each entry names the parser's own flag for that option.
    flags = {action.dest: action.option_strings for action in build_parser()._actions}
    for dest, (flag, _) in SET_BY_THE_OPERATOR.items():
        assert flag in flags[dest], (dest, flag)


def test_engine_cpus_are_refused_in_a_spec_and_api_cpus_are_taken() -> None:
    """A pod cannot know its CPU numbers before it runs: --engine-cpus would crash-loop it on a
    node where they differ; --api-cpus N names none."""
    with pytest.raises(
        InvalidSpecError, match=r"extraArgs may not set --engine-cpus: .*--api-cpus"
    ):
        parse_spec(with_extra(["--engine-cpus", "0-2"]))
    spec = parse_spec(with_extra(["--api-cpus", "1"]))
    assert spec.engine.extra_args == ["--api-cpus", "1"]


@pytest.mark.parametrize(
    ("cpu_limit", "api_cpus", "refused"),
    [("2", 1, False), ("2", 2, True), ("2500m", 2, True), ("3", 2, False), ("500m", 1, True)],
)
def test_api_cpus_must_leave_the_engine_a_cpu_of_the_limit(
    cpu_limit: str, api_cpus: int, refused: bool
) -> None:
    spec = {
        **with_extra(["--api-cpus", str(api_cpus)]),
        "resources": {"limits": {"cpu": cpu_limit}},
    }
    if not refused:
        assert parse_spec(spec).cpu_limit == float(cpu_limit)
        return
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(spec)
    assert f"--api-cpus {api_cpus} leaves the engine core no CPU of resources.limits.cpu" in str(
        caught.value
    )
