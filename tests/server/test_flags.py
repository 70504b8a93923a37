"""`kvpilot serve`'s flags read without exiting (contract/engine_flags.py, their values checked by
engine/server/from_flags.py): the verdict the command would reach, for callers that are not the
command (the operator checking extraArgs)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest

from kvpilot.contract.cpus import format_cpu_list, whole_cpus
from kvpilot.contract.engine_flags import (
    FlagError,
    build_parser,
    cpu_list,
    non_empty,
    port_number,
    positive_int,
    read_flags,
)
from kvpilot.engine.cpu.threads import read_cpu_limit
from kvpilot.engine.server.cli import main, startup_settings
from kvpilot.engine.server.from_flags import engine_config, parse_flags


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--swap-space=4"], "unrecognized arguments: --swap-space=4"),
        (["--max-queue", "many"], "argument --max-queue: invalid int value: 'many'"),
        (["--attention-backend=gpu"], "argument --attention-backend: invalid choice: 'gpu'"),
        (["--seed"], "argument --seed: expected one argument"),
        (["--enable-prefix-caching=yes"], "ignored explicit argument 'yes'"),
        (["--max-json-depth", "0"], "max_json_depth must be >= 1, got 0"),
        # Checked by the settings the flags build, not by argparse: the same rules as at start.
        (["--max-queue", "-1"], "max_queue must be >= 0, got -1"),
        (["--retry-after", "0"], "retry_after_s must be >= 1, got 0"),
        (["--shutdown-timeout", "-1"], "shutdown_timeout_s must be >= 0 and finite, got -1.0"),
        (["--shutdown-timeout", "nan"], "shutdown_timeout_s must be >= 0 and finite, got nan"),
        (["--kv-cache-gib", "-1"], "kv_cache_gib must be > 0 and finite, got -1.0"),
        (["--kv-cache-gib", "inf"], "kv_cache_gib must be > 0 and finite, got inf"),
        (["--gpu-memory-utilization", "nan"], "gpu_memory_utilization must be in (0, 1]"),
        (["--num-gpu-blocks-override", "0"], "num_blocks must be >= 1, got 0"),
        (["--distributed-timeout", "0"], "distributed_timeout_s must be > 0 and finite, got 0.0"),
        (["--seed", str(2**64)], "seed must be in [-2**63, 2**64)"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be >= 1, got 0"),
        (["--device", "gpu"], "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["--port", "65536"], "argument --port: must be in [0, 65535], got 65536"),
        (["--chat-template="], "argument --chat-template: must not be empty"),
        (["--engine-cpus", "3-1"], "argument --engine-cpus: '3-1': a range goes from low to high"),
        (["--engine-cpus", "x"], "argument --engine-cpus: 'x' is not a CPU number or range"),
        (["--api-cpus", "0"], "argument --api-cpus: must be >= 1, got 0"),
        (["--engine-cpus", "0", "--api-cpus", "1"], "not allowed with argument --engine-cpus"),
        (["--help"], "-h/--help makes `kvpilot serve` print its help and exit"),
        (["stray"], "unrecognized arguments: stray"),
    ],
)
def test_what_the_command_refuses_is_a_flag_error_not_an_exit(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(FlagError) as caught:
        parse_flags(argv)
    assert message in str(caught.value)
    assert capsys.readouterr() == ("", "")  # nothing printed: the caller reports it
    if argv != ["--help"]:  # the command itself refuses them, with status 2
        assert exit_code(argv) == 2


def exit_code(argv: list[str]) -> int | str | None:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse's own errors
        return exit_.code


def test_what_the_command_accepts_parses_with_its_values() -> None:
    args = parse_flags(["--seed", "7", "--max-queue=64", "-tp", "2", "--no-enable-prefix-caching"])
    assert (args.seed, args.max_queue, args.tensor_parallel_size) == (7, 64, 2)
    assert args.enable_prefix_caching is False
    assert args.block_size == 16  # defaults as the command has them


def test_only_given_names_the_options_set_however_written() -> None:
    given = read_flags(["--po", "9", "-tp=2", "--guided-decoding-backend", "xgrammar",
                         "--seed", "0"], only_given=True)  # fmt: skip
    # An abbreviation, an alias, a value equal to the default: all resolved to their option.
    assert sorted(vars(given)) == [
        "port",
        "seed",
        "structured_outputs_backend",
        "tensor_parallel_size",
    ]


def test_the_flags_load_no_torch() -> None:
    code = (
        "import sys\n"
        "from kvpilot.engine.server.from_flags import parse_flags\n"
        "parse_flags(['--dtype', 'bfloat16'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


# Values probed for every numeric flag: each side of each bound the flags have, and the floats
# that compare false with every bound (nan) or overflow an integer conversion (inf).
INT_PROBES = ["-1", "0", "1", "3", "7", "65535", "65536", str(2**63), str(2**64), str(-(2**63) - 1)]
FLOAT_PROBES = ["-1", "0", "1e-9", "0.5", "1", "1.5", "120", "nan", "inf", "-inf"]
# Where `kvpilot serve` refuses what the flags alone cannot tell: the bundled model's shape (9
# attention heads, 3 KV heads) takes tensor-parallel sizes 1 and 3 only.
NEEDS_THE_MODEL = {("--tensor-parallel-size", v) for v in ("7", "65535", "65536", str(2**63),
                                                           str(2**64))}  # fmt: skip


def numeric_flags() -> list[tuple[str, list[str]]]:
    """Every option of the parser that takes a number, with the values to probe."""
    flags = []
    for action in build_parser()._actions:
        if action.type in (int, port_number, positive_int) and not action.choices:
            flags.append((action.option_strings[0], INT_PROBES))
        elif action.type is float:
            flags.append((action.option_strings[0], FLOAT_PROBES))
    return flags


def serve_verdict(argv: list[str]) -> str | None:
    """What `kvpilot serve` says of argv before it starts the engine (None: it would start),
    on this machine (no GPU needed: no flag here names a device)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            args = build_parser().parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    try:
        startup_settings(args)
    except ValueError as error:
        return str(error)
    return None


def flags_verdict(argv: list[str]) -> str | None:
    try:
        parse_flags(argv)
    except FlagError as error:
        return str(error)
    return None


def test_numeric_flags_are_all_probed() -> None:
    probed = {flag for flag, _ in numeric_flags()}
    # A sample that must be there: the enumeration itself is not empty or half-blind.
    assert {"--port", "--max-queue", "--retry-after", "--kv-cache-gib", "--shutdown-timeout",
            "--tensor-parallel-size", "--distributed-timeout", "--seed",
            "--max-num-batched-tokens", "--max-tokens-limit"} <= probed  # fmt: skip
    # Every other option takes a string, one of listed choices (--block-size), or no value: a
    # number of a new type would show up here unprobed.
    others = {
        action.option_strings[0]: (action.type, bool(action.choices))
        for action in build_parser()._actions
        if action.option_strings and action.option_strings[0] not in probed
    }
    # --engine-cpus (cpu_list) is probed in tests/engine/test_cpu_affinity.py and below.
    kinds = (None, non_empty, cpu_list)
    assert all(kind in kinds or choices for kind, choices in others.values()), others


@pytest.mark.parametrize(("flag", "values"), numeric_flags(), ids=[f for f, _ in numeric_flags()])
def test_a_numeric_flag_is_refused_by_parse_flags_exactly_when_serve_refuses_it(
    flag: str, values: list[str]
) -> None:
    for value in values:
        argv = [f"{flag}={value}"]  # "=": a negative value is not read as an option
        by_flags, by_serve = flags_verdict(argv), serve_verdict(argv)
        if (flag, value) in NEEDS_THE_MODEL:
            assert by_flags is None and by_serve is not None, (argv, by_serve)
            assert "the model's" in by_serve, (argv, by_serve)
            continue
        if flag == "--api-cpus" and by_flags is None and int(value) >= cpus_for_the_engine():
            # What the flags cannot tell: this machine's CPUs (or its CPU quota).
            assert by_serve is not None and "leaves the engine core no CPU" in by_serve, argv
            continue
        if by_serve is None:
            assert by_flags is None, (argv, by_flags)
        else:
            assert by_flags is not None, (argv, by_serve)
            # The same words: argparse's own (after "kvpilot serve: error: "), or the rule's.
            assert by_serve.endswith(by_flags), (argv, by_serve, by_flags)


def cpus_for_the_engine() -> int:
    """The CPUs --api-cpus shares out here: this process's, or its quota's whole CPUs if fewer."""
    allowed, quota = len(os.sched_getaffinity(0)), read_cpu_limit()
    return min(allowed, whole_cpus(quota)) if quota is not None else allowed


def test_the_command_prints_the_message_parse_flags_gives() -> None:
    for argv, words in (
        (["--retry-after", "0"], "retry_after_s must be >= 1, got 0"),
        (["--kv-cache-gib=-0.5"], "kv_cache_gib must be > 0 and finite, got -0.5"),
    ):
        with pytest.raises(FlagError) as caught:
            parse_flags(argv)
        assert str(caught.value) == words
        result = subprocess.run(
            [sys.executable, "-m", "kvpilot.engine.server.cli", *argv],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines()[-1] == f"kvpilot serve: {words}"


FP16_ON_CPU = "dtype float16 is not supported on CPU: use float32 or bfloat16"


@pytest.mark.parametrize(
    ("argv", "gpus", "message"),
    [
        (["--device", "cuda"], 0, "device cuda needs a GPU, but none is visible: use cpu"),
        (["--device", "cuda:1"], 1, "device cuda:1 needs GPU 1, but 1 are visible"),
        (["--device", "cuda:1", "-tp", "2"], 2,
         "tensor_parallel_size 2 needs 2 GPUs, but 1 are visible from cuda:1 on"),
        (["-tp", "2"], 1, "tensor_parallel_size 2 needs 2 GPUs, but 1 are visible"),
        (["--device", "cpu", "--dtype", "float16"], 1, FP16_ON_CPU),
        (["--dtype", "float16"], 0, FP16_ON_CPU),  # auto: the CPU
        (["--device", "cuda:1"], 2, None),
        (["--dtype", "float16"], 1, None),
        (["-tp", "2"], 0, None),  # on CPU the ranks share the cores
        (["--device", "cpu"], 0, None),
    ],
)  # fmt: skip
def test_placement_is_checked_against_the_gpus_given(
    argv: list[str], gpus: int, message: str | None
) -> None:
    """EngineConfig.check_placement: torch-free, so the operator checks a pod's GPUs with it;
    `kvpilot serve` checks the GPUs it sees (startup_settings)."""
    config = engine_config(parse_flags(argv))  # the flags alone are fine
    if message is None:
        config.check_placement(gpus)
    else:
        with pytest.raises(ValueError) as caught:
            config.check_placement(gpus)
        assert str(caught.value) == message


def test_serve_refuses_a_gpu_this_machine_does_not_have(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    visible = torch.cuda.device_count()
    assert main(["--device", f"cuda:{visible}"]) == 2
    expected = "needs a GPU, but none is visible" if not visible else f"but {visible} are visible"
    assert expected in capsys.readouterr().err


def test_startup_settings_carry_the_flags() -> None:
    argv = ["--max-queue", "4", "--retry-after", "3", "--shutdown-timeout", "0"]
    args = build_parser().parse_args([*argv, "--max-stop-strings", "2"])
    config, settings = startup_settings(args)
    assert (settings.max_queue, settings.retry_after_s, settings.shutdown_timeout_s) == (4, 3, 0)
    assert settings.limits.max_stop == 2 and config.tensor_parallel_size == 1


def test_startup_places_the_engine_among_this_machines_cpus() -> None:
    """--engine-cpus and --api-cpus are checked against the CPUs this process may use, at start:
    a CPU it may not use is refused by name (exit 2), a placement it can hold is carried."""
    allowed = os.sched_getaffinity(0)
    beyond = max(allowed) + 1
    assert serve_verdict(["--engine-cpus", str(beyond)]) == (
        f"--engine-cpus {beyond}: CPU(s) {beyond} are not among this process's CPUs "
        f"{format_cpu_list(allowed)}"
    )
    assert exit_code(["--engine-cpus", str(beyond)]) == 2
    _, settings = startup_settings(build_parser().parse_args(["--engine-cpus", str(min(allowed))]))
    placement = settings.cpu_placement
    assert placement is not None and placement.engine == (min(allowed),)
    assert placement.api == (tuple(sorted(allowed - {min(allowed)})) or None)
    assert startup_settings(build_parser().parse_args([]))[1].cpu_placement is None


def test_the_priority_guard_flags_reach_the_scheduler() -> None:
    argv = ["--scheduling-policy", "priority", "--priority-guard-window", "5"]
    argv += ["--priority-guard-seqs", "2", "--priority-guard-tokens", "3"]
    config, _ = startup_settings(build_parser().parse_args(argv))
    guard = config.scheduler
    assert (guard.guard_window_s, guard.guard_step_seqs, guard.guard_step_tokens) == (5.0, 2, 3)
    # A guard that would let no worse work run at all is refused by the engine's own rules.
    assert main(["--priority-guard-tokens", "0"]) == 2
