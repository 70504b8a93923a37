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

# The longest path a Unix-domain socket may have (sockaddr_un.sun_path, less its terminating NUL).
IPC_PATH_MAX = int(getattr(zmq, "IPC_PATH_MAX_LEN", 107))
SOCKET_NAMES = ("commands", "events")
# Where the sockets go: the temporary directory ($TMPDIR), else these, for a TMPDIR whose path
# leaves no room for a socket's name (a deep emptyDir mount, a test's temporary path).
SHORT_SOCKET_PARENTS = ("/tmp", "/dev/shm")


def private_socket_dir(parents: tuple[str | None, ...] = (None, *SHORT_SOCKET_PARENTS)) -> str:
    """A new directory that only this user can enter (mkdtemp's 0700: the sockets take commands),
    in the first of `parents` (None: the temporary directory) where a socket's path fits."""
    refused: list[str] = []
    longest = max(len(name) for name in SOCKET_NAMES)
    for parent in parents:
        try:
            path = tempfile.mkdtemp(prefix="kvpilot-core-", dir=parent)
        except OSError as exc:  # a read-only root, no /dev/shm
            refused.append(f"{parent or tempfile.gettempdir()}: {exc.strerror}")
            continue
        if len(path) + 1 + longest <= IPC_PATH_MAX:
            return path
        os.rmdir(path)
        refused.append(f"{path}: longer than a Unix socket's path may be ({IPC_PATH_MAX})")
    raise RuntimeError(
        "no directory for the engine core's sockets (set TMPDIR to a short writable path): "
        + "; ".join(refused)
    )


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
        self._dir = private_socket_dir()
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a full queue
        self._commands.bind(f"ipc://{self._dir}/{SOCKET_NAMES[0]}")
        self._events = self._context.socket(zmq.PULL)
        self._events.setsockopt(zmq.RCVHWM, 0)
        self._events.bind(f"ipc://{self._dir}/{SOCKET_NAMES[1]}")
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
