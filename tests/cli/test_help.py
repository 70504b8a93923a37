"""`--help` of `kvpilot serve`, `router` and `operator`: every option explains itself and states
its default exactly once; `kvpilot serve --help` loads neither torch nor the server."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from kvpilot.contract.engine_flags import build_parser as serve_parser
from kvpilot.contract.help_format import DefaultsOnceFormatter
from kvpilot.operator.config import build_parser as operator_parser
from kvpilot.router.cli import build_parser as router_parser

PARSERS = {"serve": serve_parser, "router": router_parser, "operator": operator_parser}


def option_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help text as --help prints it (before wrapping)."""
    formatter = parser._get_formatter()
    return {
        action.option_strings[0]: formatter._expand_help(action)
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


@pytest.mark.parametrize("command", PARSERS)
def test_every_option_has_a_help_text_naming_its_default_once(command: str) -> None:
    helps = option_helps(PARSERS[command]())
    assert helps
    silent = [name for name, text in helps.items() if not text.strip()]
    assert not silent, silent
    counts = {name: len(re.findall("default", text, re.IGNORECASE)) for name, text in helps.items()}
    assert {name: n for name, n in counts.items() if n != 1} == {}, helps
    assert "(default: None)" not in PARSERS[command]().format_help()


def test_the_formatter_keeps_a_default_the_help_names_and_adds_one_it_does_not() -> None:
    parser = argparse.ArgumentParser(formatter_class=DefaultsOnceFormatter)
    parser.add_argument("--said", default=None, help="a file (default: none)")
    parser.add_argument("--unsaid", type=int, default=7, help="a count")
    parser.add_argument("--switch", action="store_true", help="a switch")
    parser.add_argument("--pair", action=argparse.BooleanOptionalAction, default=True, help="x")
    assert option_helps(parser) == {
        "--said": "a file (default: none)",
        "--unsaid": "a count (default: 7)",
        "--switch": "a switch (default: off)",
        "--pair": "x (default: on)",
    }


def test_serve_help_imports_neither_torch_nor_the_server() -> None:
    """`kvpilot serve --help` answers in well under a second: what it loads is the flags' table
    and the config classes, not torch (seconds) nor FastAPI, uvicorn or the engine."""
    code = (
        "import sys\n"
        "from kvpilot.cli import main\n"
        "try:\n"
        "    main(['serve', '--help'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "heavy = ('torch', 'fastapi', 'uvicorn', 'transformers', 'kvpilot.engine.server.run')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--disable-uvicorn-access-log" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:]


def test_the_api_process_modules_import_no_torch() -> None:
    """The server's own modules (the API process) leave torch to the engine core: importing them
    loads none of it."""
    code = (
        "import sys\n"
        "import kvpilot.engine.server.cli, kvpilot.engine.server.run\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "False"
