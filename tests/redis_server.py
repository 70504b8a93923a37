"""A real redis-server for tests: on a free loopback port, in a temporary folder, persisting
nothing; stopped and started again on the same port to play a store that goes away.

Use the fixture in a test module: `from ..redis_server import redis_server` (it needs pytest's
`tmp_path`), or `RedisServer(folder)` as a context manager anywhere else.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
START_TIMEOUT_S = 10.0
READY_LINE = "Ready to accept connections"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process; `url` names it. start() waits until it accepts connections."""

    def __init__(self, folder: Path, port: int | None = None) -> None:
        self.folder = folder
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        if self._process is not None:
            raise RuntimeError("redis-server already runs")
        command = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.folder),
            "--loglevel", "notice",
        ]  # fmt: skip
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._process = process
        assert process.stdout is not None
        seen: list[str] = []
        # The server says when it is ready; reading its log waits for exactly that moment.
        for line in process.stdout:
            seen.append(line)
            if READY_LINE in line:
                break
        else:
            self._process = None
            process.wait(timeout=START_TIMEOUT_S)
            raise RuntimeError(f"redis-server did not start:\n{''.join(seen[-20:])}")
        # After this the server logs little (nothing per connection at notice level): the
        # pipe's buffer holds it until stop() closes it.
        self._ping()

    def _ping(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=START_TIMEOUT_S) as sock:
            sock.sendall(b"PING\r\n")
            answer = sock.recv(64)
        if not answer.startswith(b"+PONG"):
            raise RuntimeError(f"redis-server answered PING with {answer!r}")

    def stop(self) -> None:
        """Kill the server (SIGKILL: a store that dies, not one that shuts down politely)."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait(timeout=START_TIMEOUT_S)
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test, killed after it."""
    with RedisServer(tmp_path) as server:
        yield server
