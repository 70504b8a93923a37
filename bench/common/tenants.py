"""What the tenancy benchmarks share: tenants as the router's manifests file reads them, a
redis-server of their own, `kvpilot router` processes, a streamed chat request as a tenant sends
it, and Jain's fairness index."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .processes import ServerProcess, free_port
from .stream_client import StreamClient, StreamError

NAMESPACE = "bench"
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@dataclass(frozen=True)
class TenantDef:
    """One Tenant and the Secret of its one key (contract/tenant_spec.py)."""

    name: str
    key: str
    priority_class: str = "standard"
    weight: int = 1
    quota: dict[str, int] | None = None

    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "apiKeys": [{"name": f"{self.name}-keys"}],
            "models": ["*"],
            "priorityClass": self.priority_class,
            "weight": self.weight,
        }
        if self.quota:
            spec["quota"] = self.quota
        return spec


def manifests(tenants: list[TenantDef]) -> str:
    """The multi-document YAML `kvpilot router --tenants-file` reads."""
    documents: list[dict[str, Any]] = []
    for tenant in tenants:
        documents.append(
            {
                "apiVersion": "kvpilot.dev/v1alpha1",
                "kind": "Tenant",
                "metadata": {"name": tenant.name, "namespace": NAMESPACE},
                "spec": tenant.spec(),
            }
        )
        documents.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{tenant.name}-keys", "namespace": NAMESPACE},
                "data": {"key": base64.b64encode(tenant.key.encode()).decode()},
            }
        )
    return yaml.safe_dump_all(documents)


def write_tenants(path: Path, tenants: list[TenantDef]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifests(tenants))
    return path


class RedisProcess:
    """A redis-server on a free loopback port persisting nothing, in `folder`."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(folder), "--loglevel", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self._pong():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def start_router(
    name: str,
    model: str,
    engine_url: str,
    args: list[str],
    log: Path,
    env: dict[str, str] | None = None,
) -> tuple[ServerProcess, str]:
    """`kvpilot router --static model=engine_url ARGS` on a free port, and its URL once ready
    (`env`: its environment, None: this process's)."""
    cmd = [sys.executable, "-m", "kvpilot.cli", "router", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--static", f"{model}={engine_url}", "--log-level", "info", *args]
    process = ServerProcess(name, cmd, "/ready", env=env, log=log)
    return process, process.wait_ready(120)


@dataclass
class Reply:
    """One streamed chat request as its client saw it (times from time.perf_counter())."""

    status: int = 0
    sent: float = 0.0
    first: float | None = None  # the first content chunk
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


async def stream_chat(
    client: StreamClient, body: dict[str, Any], key: str | None, reply: Reply | None = None
) -> Reply:
    """POST a streamed chat completion (with usage) as the tenant of `key` (None: no key).
    `reply` is filled as the answer arrives, so a caller that cancels the request keeps what
    came; a refusal or a broken connection is recorded, not raised."""
    reply = reply if reply is not None else Reply()
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}

    def on_event(data: bytes, now: float) -> None:
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        if usage := chunk.get("usage"):
            reply.prompt_tokens = usage.get("prompt_tokens", 0)
            reply.completion_tokens = usage.get("completion_tokens", 0)
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                if reply.first is None:
                    reply.first = now
                reply.chunk_times.append(now)

    headers = {"Authorization": f"Bearer {key}"} if key else None
    reply.sent = time.perf_counter()
    try:
        status, error = await client.post(
            "/v1/chat/completions", json.dumps(payload).encode(), on_event, headers
        )
        reply.status, reply.error = status, error.decode(errors="replace")[:300]
    except (OSError, TimeoutError, StreamError) as exc:
        reply.error = repr(exc)
    reply.end = time.perf_counter()
    return reply


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2), 1 when all are equal, 1/n at worst."""
    if not values or not any(values):
        return 0.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))
