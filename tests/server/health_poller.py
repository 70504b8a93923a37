"""GET /health in a loop from a process of its own (so the test's 64 clients, on their own event
loop and GIL, never delay it), until the server is gone or a stop file appears.

Each sample is one line: latency, status, and the time the server's threads and this poller spent
waiting for a CPU meanwhile (run-queue delay from /proc/.../schedstat; for the server the largest
over its threads: the loop thread waits for a CPU itself, or for the interpreter lock held by a
thread that waits for one). On a machine shared with other jobs a process can wait hundreds of
milliseconds for a core; that time is the machine's, not the server's, and the test tells the
two apart with these figures.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx


def run_delay_s(path: Path) -> float:
    """Cumulative seconds the task waited on a run queue (schedstat's second field, in ns)."""
    try:
        return int(path.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_delays(pid: int) -> dict[str, float]:
    return {
        task.name: run_delay_s(task / "schedstat") for task in Path(f"/proc/{pid}/task").iterdir()
    }


def main(url: str, server_pid: int, out: Path, stop: Path) -> None:
    own = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")
    with httpx.Client(timeout=10) as http, out.open("a") as sink:
        http.get(f"{url}/health")  # the connection, outside the samples
        while not stop.exists():
            server_before, own_before = thread_delays(server_pid), run_delay_s(own)
            started = time.perf_counter()
            try:
                status = http.get(f"{url}/health").status_code
            except httpx.TransportError:
                return  # the server has exited
            latency = time.perf_counter() - started
            server_after = thread_delays(server_pid)
            server_wait = max(
                (
                    server_after[t] - before
                    for t, before in server_before.items()
                    if t in server_after
                ),
                default=0.0,
            )
            own_wait = run_delay_s(own) - own_before
            sink.write(f"{latency:.6f} {status} {server_wait:.6f} {own_wait:.6f}\n")
            sink.flush()
            time.sleep(0.02)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
