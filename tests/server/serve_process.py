"""A real `kvpilot serve` process for tests: started on a free port, its log read, its engine-core
child found."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class ServeProcess:
    proc: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)
    port: int | None = None
    # (/health, /ready) while starting
    statuses: list[tuple[int, int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))

    def core_pid(self) -> int:
        """The engine-core child (multiprocessing's resource tracker is the other child)."""
        for pid in child_pids(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline:
                return pid
        raise AssertionError(
            f"no engine-core child of {self.proc.pid}: {child_pids(self.proc.pid)}"
        )


def health_until_exit(serve: ServeProcess, http: httpx.Client) -> list[int]:
    """/health's status codes, polled until the server stops answering or exits."""
    healths = []
    while serve.proc.poll() is None:
        try:
            healths.append(http.get(f"{serve.url}/health", timeout=1).status_code)
        except httpx.TransportError:
            break
        time.sleep(0.02)
    return healths


def child_pids(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            children += [int(p) for p in f.read().split()]
    return children


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@contextmanager
def launch_serve(
    *args: str,
    ready_timeout: float = 240,
    wrapper: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[ServeProcess]:
    """`kvpilot serve --port 0 ARGS` with one torch thread (the second core is left to HTTP and
    the test's clients), ready when this yields; killed at exit if still running. `wrapper` runs
    it through another command (which must exec it); `env` adds variables."""
    cmd = [*wrapper, sys.executable, "-m", "kvpilot.cli", "serve", "--port", "0", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    served = ServeProcess(proc)
    threading.Thread(target=served.read_log, daemon=True).start()
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            assert proc.poll() is None, "".join(served.log)
            assert time.monotonic() < deadline, "kvpilot serve did not become ready"
            if served.port is not None:
                try:
                    health = httpx.get(f"{served.url}/health", timeout=2).status_code
                    ready = httpx.get(f"{served.url}/ready", timeout=2).status_code
                    served.statuses.append((health, ready))
                    if ready == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# A private mount namespace where / is read-only and only $SCRATCH and $CACHE stay writable, as
# in the operator's pods (readOnlyRootFilesystem; /tmp and the cache are volumes).
READ_ONLY_ROOT = (
    'mount --bind "$SCRATCH" "$SCRATCH" && mount --bind "$CACHE" "$CACHE" && '
    'mount -o remount,bind,ro / && exec "$@"'
)


def read_only_wrapper() -> tuple[str, ...]:
    return ("unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_ROOT, "sh")


def can_make_root_read_only(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        [*read_only_wrapper(), "true"],
        env={"SCRATCH": str(tmp_path), "CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
    )
    return probe.returncode == 0


def spec_counters(url: str) -> dict[str, float]:
    """The server's vllm:spec_decode_num_* counters (without the per-position ones)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:spec_decode_num_") and "position" not in sample.labels
    }
