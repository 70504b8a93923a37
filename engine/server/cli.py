"""`kvpilot serve`: its flags (vLLM's names where it has one) read and checked, the engine's
configs, the listening socket; then the server (engine/server/run.py).

A port in use, like a refused flag, ends the command before anything loads. The server's
libraries are imported after the flags are read, so that --help answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from kvpilot.contract.engine_flags import API_KEY_ENV, build_parser
from kvpilot.engine.config import LOG_FORMAT, EngineConfig
from kvpilot.engine.cpu.affinity import place
from kvpilot.engine.cpu.threads import read_cpu_limit
from kvpilot.engine.server.from_flags import (
    engine_config,
    server_settings,
    with_runtime_lora_env,
)
from kvpilot.engine.server.settings import ChatOptions, ServerSettings
from kvpilot.engine.visible_gpus import visible_gpu_count

logger = logging.getLogger("kvpilot.server")
LISTEN_BACKLOG = 2048  # uvicorn's default


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the value itself when it is a template (as vLLM
    takes it). ValueError for a path that cannot be read."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value:
        try:
            return path.read_text()
        except OSError as exc:
            raise ValueError(f"--chat-template: {exc.strerror}: {value}") from None
    return value


def resolve_api_key(flag: str | None, file: str | None, env: Mapping[str, str]) -> str | None:
    """The API key from the flag, a file or the environment (in that order; at most one of the
    first two). ValueError for an unreadable or empty file."""
    if flag is not None and file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if file is not None:
        try:
            key = Path(file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file: {exc.strerror}: {file}") from None
        if not key:
            raise ValueError(f"--api-key-file: {file} is empty")
        return key
    if flag is not None:
        logger.warning(
            "--api-key shows in the process list: prefer --api-key-file or $%s", API_KEY_ENV
        )
        return flag
    return env.get(API_KEY_ENV) or None


def startup_settings(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """Everything `kvpilot serve` checks before it starts the engine (ValueError): the flags'
    values (as parse_flags checks them, in engine/server/from_flags.py), then what only this machine
    can tell: its GPUs and CPUs, the model's shape, the files named."""
    config = with_runtime_lora_env(engine_config(args), os.environ)
    check_placement(config)
    cpu_placement = place(
        os.sched_getaffinity(0),
        read_cpu_limit(),
        os.environ,
        engine_cpus=args.engine_cpus,
        api_cpus=args.api_cpus,
    )
    check_parallelism(config)
    settings = server_settings(
        args,
        api_key=resolve_api_key(args.api_key, args.api_key_file, os.environ),
        chat=ChatOptions(
            chat_template=read_chat_template(args.chat_template),
            tool_call_parser=args.tool_call_parser,
        ),
        cpu_placement=cpu_placement,
    )
    return config, settings


def check_placement(config: EngineConfig) -> None:
    """ValueError for a device or dtype the GPUs of this machine cannot serve (counted without
    torch: engine/visible_gpus.py)."""
    config.check_placement(visible_gpu_count())


def open_listener(host: str, port: int) -> socket.socket:
    """The server's listening socket, opened before the model loads, so that a port in use ends
    `kvpilot serve` at once. OSError naming host:port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def check_parallelism(config: EngineConfig) -> None:
    """ValueError, with the numbers, for a tensor-parallel size this model or machine cannot
    take: checked here so that no process starts for it."""
    if config.tensor_parallel_size == 1:
        return
    from kvpilot.engine.executor.launch import visible_gpus
    from kvpilot.engine.model.loader import peek_model_config
    from kvpilot.engine.parallel.sharding import check_tensor_parallel_size

    check_tensor_parallel_size(
        peek_model_config(config.model), config.tensor_parallel_size, num_gpus=visible_gpus(config)
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        config, settings = startup_settings(args)
    except ValueError as exc:
        print(f"kvpilot serve: {exc}", file=sys.stderr)
        return 2

    try:
        listener = open_listener(args.host, args.port)
    except OSError as exc:
        print(f"kvpilot serve: {exc}", file=sys.stderr)
        return 1

    # Imported only now: `kvpilot serve --help` and a refused flag answer without the server's
    # libraries (seconds); the engine core starts no later for it.
    from kvpilot.engine.server.run import serve

    return serve(args, config, settings, listener)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
