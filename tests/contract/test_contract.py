"""kvpilot.contract: torch-free and importing no side of the product, the router's imports going
through it, and `kvpilot serve`'s flags exactly as recorded (tests/contract/serve_flags.json)."""

from __future__ import annotations

import argparse
import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvpilot.contract
from kvpilot.contract.engine_flags import build_parser

REPO = Path(__file__).resolve().parents[2]
SIDES = ("kvpilot.engine", "kvpilot.operator", "kvpilot.router", "kvpilot.cli")


def contract_modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(kvpilot.contract.__path__, "kvpilot.contract.")]


def test_the_contract_has_the_modules_it_is_checked_by() -> None:
    assert {"kvpilot.contract.openai", "kvpilot.contract.engine_flags"} <= set(contract_modules())


def test_every_contract_module_loads_no_torch_and_no_side_of_the_product() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {contract_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')\n"
        f"                or m.startswith({SIDES!r}))\n"
        "print(loaded)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "[]"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (`from a.b import c` counts a.b and a.b.c)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("path", sorted((REPO / "router").glob("*.py")), ids=lambda p: p.name)
def test_the_router_takes_the_contract_from_kvpilot_contract(path: Path) -> None:
    imported = imported_modules(path)
    for module in (
        "kvpilot.engine.server.errors",
        "kvpilot.engine.server.protocol",
        "kvpilot.engine.server.kv_events",
    ):
        assert module not in imported, module
    assert not {m for m in imported if m == "kvpilot.operator" or m.startswith("kvpilot.operator.")}
    # Of the engine's server it shares one piece of logic: tokenizing a request as it does.
    server = {m for m in imported if m.startswith("kvpilot.engine.server.")}
    assert server <= {"kvpilot.engine.server.preprocess"} | {
        f"kvpilot.engine.server.preprocess.{name}"
        for name in ("PromptLimits", "chat_request_prompt", "completion_prompts")
    }


def flag_record(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Everything a change to a flag would show in: each option's names, dest, default, choices,
    nargs, type, help and action; the groups and the exclusive sets; the --help text."""

    def name(value: Any) -> Any:
        if isinstance(value, type) or callable(value):
            return getattr(value, "__name__", repr(value))
        return list(value) if isinstance(value, tuple) else value

    actions = [
        [a.option_strings, a.dest, name(a.default), name(a.choices), a.nargs, a.required,
         a.help, name(a.type), a.metavar, type(a).__name__, a.const]
        for a in parser._actions
    ]  # fmt: skip
    record = {
        "actions": actions,
        "groups": [[g.title, [a.dest for a in g._group_actions]] for g in parser._action_groups],
        "mutex": [[a.dest for a in g._group_actions] for g in parser._mutually_exclusive_groups],
        "help": parser.format_help(),
        "prog": parser.prog,
        "description": parser.description,
        "formatter": parser.formatter_class.__name__,
    }
    return json.loads(json.dumps(record, default=repr))


def test_serve_flags_are_the_recorded_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed flag (a default, a choice, a help text, its place in --help) fails here: change
    serve_flags.json with it, on purpose."""
    monkeypatch.setenv("COLUMNS", "100")  # the width the --help text was recorded at
    recorded = json.loads((Path(__file__).parent / "serve_flags.json").read_text())
    assert flag_record(build_parser()) == recorded
