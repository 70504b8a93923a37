"""Processes the benchmarks start and watch: a server in its own process group (log, readiness,
CPU time, stop), and the process-group helpers every side-by-side run uses to stop, measure and
wait for quiet."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx


class ServerProcess:
    """A server as a subprocess in its own process group. Its output (stdout and stderr) is copied
    to `log` when given; ERROR lines and tracebacks are echoed to our stderr. `wait_ready` polls
    `ready_path` until 200; the port is `port`, or read from the "Uvicorn running on" line."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        ready_path: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.ready_path = ready_path
        self.log = log
        self.port: list[int] = [port] if port else []
        print(f"launching {name}:", shlex.join(cmd), file=sys.stderr)
        if log:
            log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # stop() can then end its children too (vLLM has two)
        )
        threading.Thread(target=self._read_output, daemon=True).start()

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        sink = self.log.open("w") if self.log else None
        for line in self.proc.stdout:
            if sink:
                sink.write(line)
                sink.flush()
            if not self.port and (
                found := re.search(r"Uvicorn running on http://[\d.]+:(\d+)", line)
            ):
                self.port.append(int(found.group(1)))
            if re.search(r"\bERROR\b|Traceback", line):
                sys.stderr.write(f"[{self.name}] {line}")
        if sink:
            sink.close()

    def wait_ready(self, timeout: float = 900) -> str:
        """Its base URL, once `ready_path` answers 200."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                where = f"; its log: {self.log}" if self.log else ""
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}{where}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not become ready in {timeout:.0f} s")
            if self.port:
                try:
                    url = f"http://127.0.0.1:{self.port[0]}"
                    if httpx.get(url + self.ready_path).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            time.sleep(0.5)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the live processes of its group."""
        return group_cpu_seconds(self.proc.pid)  # its own, from start_new_session

    def api_cpu_seconds(self) -> float:
        """CPU time of the launched process alone (all its threads, none of its children): for
        kvpilot and vLLM both, the API server, whose engine core is a child process."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its whole group if it is not gone within 60 s; children it
        left behind after exiting get the same."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        stop_group(self.proc, grace_s=10)


def kvpilot_serve_cmd(serve_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvpilot.cli", "serve", "--port", "0", *serve_args]


@contextmanager
def launched_server(serve_args: list[str], log: Path | None = None) -> Iterator[str]:
    """`kvpilot serve --port 0 ...` as a subprocess; yields its base URL once /ready is 200."""
    server = ServerProcess("kvpilot serve", kvpilot_serve_cmd(serve_args), "/ready", log=log)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def first_200(
    url: str, proc: subprocess.Popen[Any], deadline: float, what: str, interval_s: float = 0.02
) -> float:
    """time.time() when `url` first answers 200, polled every interval_s (a start-up's end, to
    the poll's precision); RuntimeError naming `what` when proc exits or the time.time()
    deadline passes first."""
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return time.time()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"{what}: {url} not 200 in time")


def with_source(env: dict[str, str], src: str | None) -> dict[str, str]:
    """env with src (a directory holding a `kvpilot` package, a baseline's) first on PYTHONPATH,
    if given."""
    if src is None:
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 0.0) -> None:
    """After `proc` was asked to stop: waits up to `grace_s` for it and the rest of its process
    group (it was started with start_new_session, so the group is its own and its children's,
    e.g. vLLM's engine-core and model worker) to exit, then SIGKILLs whatever is left of it."""
    deadline = time.monotonic() + grace_s
    while True:
        proc.poll()  # reaps it once exited: a zombie would still count as a group member
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() >= deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait(30)


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by the live processes of process group `pgid` (a
    worker or server started with start_new_session, and the children it started)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def wait_until_idle(
    pgids: list[int], quiet_cpu_s: float = 0.05, window_s: float = 1.0, timeout_s: float = 60.0
) -> float:
    """Wait until the process groups together use under `quiet_cpu_s` of CPU in `window_s`;
    returns the seconds waited. vLLM keeps working for a while after its last answer (its engine
    core used ~1 CPU-s after its runs, offline and serving): without this, whichever system runs
    right after the other pays for the other's tail on 2 cores, which the alternating order gives
    kvpilot in 2 of 3 rounds."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        before = sum(group_cpu_seconds(pgid) for pgid in pgids)
        time.sleep(window_s)
        if sum(group_cpu_seconds(pgid) for pgid in pgids) - before < quiet_cpu_s:
            break
    return round(time.perf_counter() - start, 3)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
