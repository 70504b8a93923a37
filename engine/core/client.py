"""The API process's handle on the engine-core process: start it, send it commands, receive its
events, notice when it dies.

Commands go over a ZMQ PUSH socket and events come back over a PULL socket, both on Unix-domain
sockets in a private temporary directory, as msgpack (see messages.py). `send` may be called from
any thread; `receive` from one thread only.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading

import msgspec
import zmq

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.core.messages import Command, CoreEvent, Shutdown
from kvpilot.engine.core.process import run_engine_core

log = logging.getLogger("kvpilot.server")


class CoreProcessExited(RuntimeError):
    """The engine-core process is gone."""

    def __init__(self, exitcode: int | None) -> None:
        super().__init__(f"the engine core process exited (exit code {exitcode})")
        self.exitcode = exitcode


class EngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        num_threads: int | None = None,
        cpus: tuple[int, ...] | None = None,
        log_level: int = logging.INFO,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvpilot-core-")
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a full queue
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._events = self._context.socket(zmq.PULL)
        self._events.setsockopt(zmq.RCVHWM, 0)
        self._events.bind(f"ipc://{self._dir}/events")
        # spawn, not fork: this process runs threads (uvicorn, this client's reader), and a CUDA
        # child must not inherit a parent's state.
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(
                config,
                self._commands.getsockopt_string(zmq.LAST_ENDPOINT),
                self._events.getsockopt_string(zmq.LAST_ENDPOINT),
                os.getpid(),
                num_threads,
                log_level,
                cpus,
            ),
            name="kvpilot-engine-core",
            daemon=True,
        )
        self._poller = zmq.Poller()
        self._poller.register(self._events, zmq.POLLIN)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreEvent)
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        self._process.start()
        self._poller.register(self._process.sentinel, zmq.POLLIN)

    def send(self, command: Command) -> None:
        data = self._encoder.encode(command)
        with self._send_lock:
            if not self._closed:
                self._commands.send(data, copy=False)

    def receive(self, timeout_s: float) -> CoreEvent | None:
        """The next event, None after timeout_s without one; raises CoreProcessExited once the
        process is gone and every event it sent has been read."""
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._events in ready:
            return self._decoder.decode(self._events.recv(copy=False).buffer)
        if ready:  # only the sentinel: the process has exited
            self._process.join(timeout=1)
            raise CoreProcessExited(self._process.exitcode)
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop; kill it if it has not within timeout_s."""
        if self._process.pid is None or not self._process.is_alive():
            return
        self.send(Shutdown())
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.warning("the engine core did not stop in %.0f s: killing it", timeout_s)
            self._process.kill()
            self._process.join(5)

    def close(self) -> None:
        """Close the sockets (after the process stopped and nobody calls receive any more)."""
        if self._closed:
            return
        with self._send_lock:
            self._closed = True
            self._commands.close(linger=0)
        self._events.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
