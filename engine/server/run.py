"""The running server: the engine core started, uvicorn on the listening socket, a log line
when it turns ready, graceful drain.

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
import socket
import time
from types import FrameType

import uvicorn
from prometheus_client import CollectorRegistry

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.cpu.affinity import bind_this_process
from kvpilot.engine.server.app import create_app
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.settings import ServerSettings
from kvpilot.engine.server.state import ServerState

logger = logging.getLogger("kvpilot.server")
# After the engine core died: long enough for failed requests' error bodies to go out and for a
# probe to read /health 503, short enough that the pod restarts at once.
ENGINE_DEAD_LINGER_S = 1.0


def base_url(host: str, sock: socket.socket) -> str:
    """http://HOST:PORT of a listening socket (its real port when --port 0 picked one)."""
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing the listener."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float, url: str
    ) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.url = url
        self.announced_ready = False
        self.drain_requested = False
        self.drain_started: float | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets is not None and self.started:
            # uvicorn says where it listens only for sockets it opened itself; tools (and
            # people) read this line for the port.
            self._log_started_message(sockets)

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
        if not self.announced_ready and self.state.is_ready:
            # uvicorn ticks every 0.1 s: the line follows /ready's first 200 that closely.
            self.announced_ready = True
            self.state.start_big_body_worker()
            logger.info("ready at %s", self.url)
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


def serve(
    args: argparse.Namespace,
    config: EngineConfig,
    settings: ServerSettings,
    listener: socket.socket,
) -> int:
    """Start the engine core and serve on `listener` until a drain or the core's death ends it:
    the process's exit status."""
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
        access_log=False,  # access_log.py logs each request instead, without its client address
    )
    server = DrainingServer(
        uv_config, state, settings.shutdown_timeout_s, base_url(args.host, listener)
    )
    logger.info("loading %s", args.model or "the bundled SmolLM2-135M-Instruct")
    engine.start()
    if placement:
        # After the core's start: it is spawned with this process's CPUs and binds itself.
        if placement.api:
            bind_this_process(placement.api)
        logger.info("%s", placement.describe())
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
        state.close()
        engine.shutdown()
    if engine.error is not None:
        if engine.info is None:
            logger.error("exiting: the model could not be loaded: %s", engine.error)
        else:
            logger.error("exiting: %s", engine.error)
        return 1
    return 0
