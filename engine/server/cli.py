"""`kvpilot serve`: flags (vLLM's names where it has one), engine configs, uvicorn, graceful drain.

The HTTP server listens at once, and the model loads in the engine-core process meanwhile: /health
answers 200 during the load, /ready 503 until the model is servable (what a Kubernetes startup probe
wants). If the engine core dies, /health turns 503 and the process exits 1.

SIGTERM starts a drain instead of uvicorn's immediate close: /ready turns 503, new requests get a
503 (the listener stays open, because endpoints are removed from Services only after the pod is told
to stop), and in-flight requests, streams included, run to completion for up to --shutdown-timeout
seconds; then uvicorn shuts down and the process exits 0. A second SIGTERM or SIGINT exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

import uvicorn
from prometheus_client import CollectorRegistry

from kvpilot.contract.engine_flags import API_KEY_ENV, build_parser
from kvpilot.engine.config import LOG_FORMAT, EngineConfig
from kvpilot.engine.cpu.affinity import bind_this_process, place
from kvpilot.engine.cpu.threads import read_cpu_limit
from kvpilot.engine.server.app import create_app
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.from_flags import (
    engine_config,
    server_settings,
    with_runtime_lora_env,
)
from kvpilot.engine.server.settings import ChatOptions, ServerSettings
from kvpilot.engine.server.state import ServerState

logger = logging.getLogger("kvpilot.server")
# After the engine core died: long enough for failed requests' error bodies to go out and for a
# probe to read /health 503, short enough that the pod restarts at once.
ENGINE_DEAD_LINGER_S = 1.0


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
    """ValueError for a device or dtype the GPUs of this machine cannot serve."""
    import torch

    config.check_placement(torch.cuda.device_count())


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


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing the listener."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.drain_requested = False
        self.drain_started: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes: only set flags; on_tick does the work.
        # Not recording the signal keeps uvicorn from re-raising it at exit (which would make
        # the exit status 143 instead of 0).
        if self.drain_requested or self.drain_started is not None:
            logger.warning("second signal: exiting without waiting for in-flight requests")
            self.should_exit = True
            self.force_exit = True
        else:
            self.drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        engine = self.state.engine
        if engine.error is not None and (
            not engine.is_loaded
            or time.monotonic() - (engine.died_at or 0.0) > ENGINE_DEAD_LINGER_S
        ):
            # Nothing to serve: exit non-zero so the container restarts, rather than hang.
            self.force_exit = True
            return True
        if self.drain_requested and self.drain_started is None:
            self.drain_started = time.monotonic()
            self.state.start_draining()
        if self.drain_started is not None and not self.should_exit:
            await super().on_tick(counter)  # keeps the Date header fresh
            if self.state.num_in_flight == 0:
                engine = self.state.engine
                logger.info(
                    "drained: no request in flight (engine: %d running, %d waiting, KV cache "
                    "usage %.1f%%)",
                    engine.num_running,
                    engine.num_waiting,
                    100 * engine.kv_cache_usage,
                )
                return True
            if time.monotonic() - self.drain_started > self.shutdown_timeout:
                logger.warning(
                    "shutdown timeout (%.0f s) reached with %d request(s) in flight; cutting them",
                    self.shutdown_timeout,
                    self.state.num_in_flight,
                )
                # Each cut request ends with an error its client can read, then uvicorn closes.
                self.state.cut_all()
                return True
            return False
        return await super().on_tick(counter)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        config, settings = startup_settings(args)
    except ValueError as exc:
        print(f"kvpilot serve: {exc}", file=sys.stderr)
        return 2

    registry = CollectorRegistry()
    placement = settings.cpu_placement
    # The engine core (model, KV cache, scheduler) runs in a child process it starts; it fits its
    # torch threads to the container's CPU quota there, or to --engine-cpus.
    engine = AsyncEngine(
        config,
        registry=registry,
        vllm_metrics=not args.disable_vllm_metrics,
        core_threads=placement.engine_threads if placement else None,
        core_cpus=placement.engine if placement else None,
        log_level=getattr(logging, args.log_level.upper()),
    )
    state = ServerState(engine, settings)
    uv_config = uvicorn.Config(
        create_app(state),
        host=args.host,
        port=args.port,
        log_config=None,  # keep our logging setup; uvicorn's loggers propagate to it
        log_level=args.log_level,
        timeout_graceful_shutdown=5,  # after the drain: only cut-off requests are left
        access_log=args.log_level == "debug",
    )
    server = DrainingServer(uv_config, state, settings.shutdown_timeout_s)
    logger.info("loading %s", args.model or "the bundled SmolLM2-135M-Instruct")
    engine.start()
    if placement:
        # After the core's start: it is spawned with this process's CPUs and binds itself.
        if placement.api:
            bind_this_process(placement.api)
        logger.info("%s", placement.describe())
    try:
        server.run()
    finally:
        state.close()
        engine.shutdown()
    if engine.error is not None:
        if engine.info is None:
            logger.error("exiting: the model could not be loaded: %s", engine.error)
        else:
            logger.error("exiting: %s", engine.error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
