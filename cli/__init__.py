"""The `kvpilot` command: `generate` (offline demo), `serve` (the engine's HTTP server),
`operator` (the Kubernetes operator), `router` (one endpoint for every InferenceService).

It lives beside the engine and the operator, not in either: each command imports only its own
side, so the engine never learns that the operator exists, the operator never pays for torch, and
serve never pays for kopf.
"""

from __future__ import annotations

import importlib.metadata
import sys

USAGE = """usage: kvpilot [--version] {generate,serve,operator,router,prepare} [options]

  generate   run the engine offline on a few chat prompts (default model: bundled
  SmolLM2-135M-Instruct)
  serve      serve an OpenAI-compatible API on one model
  operator   run the Kubernetes operator (kopf)
  router     route OpenAI requests to InferenceServices (prefix-cache aware, scale from zero)
  prepare    convert a model into the shared model cache; prebuild the CPU kernels

`kvpilot COMMAND --help` for the options of each command."""


def version() -> str:
    """The installed distribution's version (pyproject.toml's)."""
    try:
        return importlib.metadata.version("kvpilot")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # a command is required: usage on stderr, exit 2, as argparse does
        print(USAGE, file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] in ("-V", "--version"):
        print(f"kvpilot {version()}")
        return 0
    command, rest = args[0], args[1:]
    # Imported only now (see the module docstring).
    if command == "generate":
        from kvpilot.engine.generate_cli import main as run
    elif command == "serve":
        from kvpilot.engine.server.cli import main as run
    elif command == "prepare":
        from kvpilot.engine.prepare import main as run
    elif command == "operator":
        from kvpilot.operator.cli import main as run
    elif command == "router":
        from kvpilot.router.cli import main as run
    else:
        print(f"kvpilot: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)
