"""The `kvpilot` command (kvpilot.cli): dispatch, and each command importing only its own side."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from kvpilot.cli import main


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_usage_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "generate,serve,operator" in capsys.readouterr().out
    # No command: usage on stderr and exit status 2, as argparse does for a missing argument.
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: kvpilot" in captured.err
    assert main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err


# Of the engine, the operator loads only the value rules of `kvpilot serve`'s flags (torch-free):
# the engine's and the server's settings, which it checks spec.engine.extraArgs with (the parser
# itself, the choices, the CPU-list rules and the request limits are kvpilot.contract's).
ENGINE_FLAGS = (
    "kvpilot.engine",
    "kvpilot.engine.config",
    "kvpilot.engine.cpu",
    "kvpilot.engine.cpu.affinity",
    "kvpilot.engine.server",
    "kvpilot.engine.server.from_flags",
    "kvpilot.engine.server.settings",
)


@pytest.mark.parametrize(
    ("command", "usage", "never_imported", "allowed"),
    (
        ("operator", "usage: kvpilot operator", ("torch", "kvpilot.engine"), ENGINE_FLAGS),
        ("serve", "usage: kvpilot serve", ("kopf", "kvpilot.operator"), ()),
        ("generate", "usage: kvpilot generate", ("kopf", "kvpilot.operator"), ()),
    ),
)
def test_each_command_imports_only_its_side(
    command: str, usage: str, never_imported: tuple[str, ...], allowed: tuple[str, ...]
) -> None:
    code = (
        "import sys\n"
        "from kvpilot.cli import main\n"
        "try:\n"
        f"    code = main([{command!r}, '--help'])\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "assert code in (0, None), code\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({never_imported!r})\n"
        f"                and m not in {allowed!r})\n"
        "assert not loaded, loaded\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr[-4000:]
    assert usage in result.stdout


def test_version_is_the_installed_packages() -> None:
    result = run_python("-m", "kvpilot.cli", "--version")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == f"kvpilot {importlib.metadata.version('kvpilot')}"
    assert importlib.metadata.version("kvpilot")[0].isdigit()


def test_serve_help_is_grouped() -> None:
    from kvpilot.engine.server.cli import build_parser

    groups = {
        group.title: {action.dest for action in group._group_actions}
        for group in build_parser()._action_groups
    }
    expected = {
        "model": {"model", "served_model_name"},
        "HTTP": {"host", "port", "api_key", "api_key_file"},
        "KV cache": {"block_size", "kv_cache_gib", "gpu_memory_utilization"},
        "scheduler": {"max_num_seqs", "max_num_batched_tokens", "max_model_len"},
        "request limits": {"max_queue", "max_request_body_bytes", "max_stop_strings"},
    }
    for title, dests in expected.items():
        assert dests <= groups.get(title, set()), (title, groups.get(title))
    # Every option sits in a named group; only -h is left among argparse's own "options".
    assert groups["options"] == {"help"}


def test_python_dash_m() -> None:
    result = run_python("-m", "kvpilot.cli", "serve", "--help")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "usage: kvpilot serve" in result.stdout
