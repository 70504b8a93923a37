"""A real uvicorn server for an app, on a background thread and a loopback ephemeral port.

For tests and tools that want the genuine HTTP path (the openai client, streaming, disconnects)
without a subprocess: several of them can share one AsyncEngine, each with its own settings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.server.app import create_app
from kvpilot.engine.server.state import ServerState


def scrape_metrics(url: str) -> dict[str, float]:
    """`url/metrics` as {"name{label=value,...}": value}; labels sorted, model_name and vLLM's
    engine index left out (so vllm:x and kvpilot:x read alike)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@dataclass
class InProcessServer:
    url: str
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def serve_in_thread(
    state: ServerState,
    *,
    make_server: Callable[[uvicorn.Config], uvicorn.Server] = uvicorn.Server,
    host: str = "127.0.0.1",
    startup_timeout: float = 30.0,
) -> InProcessServer:
    """Start serving `state` on a free port; returns once the socket listens."""
    config = uvicorn.Config(
        create_app(state), host=host, port=0, log_level="warning", lifespan="off"
    )
    server = make_server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return InProcessServer(f"http://{host}:{port}", state, server, thread)
