"""`kvpilot serve`'s flags read without exiting (engine/server/flags.py): the verdict the command
would reach, for callers that are not the command (the operator checking extraArgs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.engine.server.cli import main
from kvpilot.engine.server.flags import FlagError, parse_flags


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--enforce-eager"], "unrecognized arguments: --enforce-eager"),
        (["--max-queue", "many"], "argument --max-queue: invalid int value: 'many'"),
        (["--attention-backend=gpu"], "argument --attention-backend: invalid choice: 'gpu'"),
        (["--seed"], "argument --seed: expected one argument"),
        (["--enable-prefix-caching=yes"], "ignored explicit argument 'yes'"),
        (["--max-json-depth", "0"], "max_json_depth must be >= 1, got 0"),
        (["--chat-template="], "argument --chat-template: must not be empty"),
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
    given = parse_flags(["--po", "9", "-tp=2", "--guided-decoding-backend", "xgrammar",
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
        "from kvpilot.engine.server.flags import parse_flags\n"
        "parse_flags(['--dtype', 'bfloat16'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
