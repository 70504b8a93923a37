"""The `kvpilot` command (kvpilot.cli): dispatch, and each command importing only its own side."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.cli import main


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_usage_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert main(["--help"]) == 0
    assert "generate,serve,operator" in capsys.readouterr().out
    assert main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "usage", "never_imported"),
    (
        ("operator", "usage: kvpilot operator", ("torch", "kvpilot.engine")),
        ("serve", "usage: kvpilot serve", ("kopf", "kvpilot.operator")),
        ("generate", "usage: kvpilot generate", ("kopf", "kvpilot.operator")),
    ),
)
def test_each_command_imports_only_its_side(
    command: str, usage: str, never_imported: tuple[str, ...]
) -> None:
    code = (
        "import sys\n"
        "from kvpilot.cli import main\n"
        "try:\n"
        f"    code = main([{command!r}, '--help'])\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "assert code in (0, None), code\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({never_imported!r}))\n"
        "assert not loaded, loaded\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr[-4000:]
    assert usage in result.stdout


def test_python_dash_m() -> None:
    result = run_python("-m", "kvpilot.cli", "serve", "--help")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "usage: kvpilot serve" in result.stdout
