"""The load generator: streamed requests over common/stream_client.py, each one's timings in a
RequestResult, a whole workload's run (arrivals, concurrency cap, /health probe, the server's
counters before and after) and its summary: throughput and TTFT / TPOT / ITL / end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import threading
import time
import urllib.parse
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import msgspec
from tqdm import tqdm

from common.dataset import BenchRequest, arrival_offsets, request_body
from common.stats import percentile, stats_ms
from common.stream_client import StreamClient, StreamError

try:
    import uvloop
except ImportError:  # not on Windows
    uvloop = None


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # seconds since the run started
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([g for r in ok for g in r.itls]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
    }


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None


class _Chunk(msgspec.Struct):
    """The fields of a streamed completion or chat chunk the benchmark reads (others skipped)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_CHUNK_DECODER = msgspec.json.Decoder(_Chunk)


async def send(
    client: StreamClient, path: str, body: dict[str, Any], result: RequestResult, t0: float
) -> None:
    """One streamed request, recorded in `result`: each text chunk's arrival time (TTFT, then
    the inter-token gaps), the usage of the last chunk, or the error."""
    start = time.perf_counter()
    result.start = start - t0
    last = start

    def on_event(data: bytes, now: float) -> None:
        nonlocal last
        if result.error or data == b"[DONE]":
            return
        try:
            chunk = _CHUNK_DECODER.decode(data)
        except msgspec.DecodeError as exc:
            result.error = f"bad chunk {data[:200]!r}: {exc}"
            return
        if chunk.error is not None:
            result.error = str(chunk.error)
            return
        if chunk.usage is not None:
            result.prompt_tokens = chunk.usage.prompt_tokens
            result.output_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            result.cached_tokens = (details.cached_tokens or 0) if details else 0
        for choice in chunk.choices or ():
            text = choice.text or (choice.delta.content if choice.delta else None)
            if not text:
                continue
            if result.ttft == 0.0:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now

    try:
        status, error_body = await client.post(path, json.dumps(body).encode(), on_event)
    except (OSError, StreamError, TimeoutError) as exc:
        result.error = repr(exc)
        return
    if status != 200:
        result.error = f"HTTP {status}: {error_body[:200]!r}"
        return
    result.e2e = time.perf_counter() - start
    result.ok = result.ttft > 0 and not result.error


class HealthProbe:
    """GETs `url` every `interval` s (a new probe right away when one took longer) until stopped,
    recording each latency and counting non-200 answers. It runs on its own thread with its own
    keep-alive connection: on the load generator's event loop each probe would also wait behind
    the queue of stream chunks, which is the client's delay, not the server's. A prebuilt request
    on a plain socket, the answer read up to its length: ten probes a second cost the 2-core
    machine ~0.4 CPU s per 27 s run through httpx and ~0.09 per 10 s run through http.client
    (its header parsing), taken from the server they measure."""

    def __init__(self, url: str, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        url = urllib.parse.urlsplit(self.url)
        address = (url.hostname or "127.0.0.1", url.port or 80)
        request = f"GET {url.path or '/'} HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode()
        sock: socket.socket | None = None
        try:
            next_at = time.perf_counter()
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    if sock is None:
                        sock = socket.create_connection(address, timeout=30)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.sendall(request)
                    status, keep_alive = read_response(sock)
                    ok = status == 200
                except (OSError, ValueError):
                    ok, keep_alive = False, False
                if not keep_alive and sock is not None:
                    sock.close()  # the next probe connects afresh
                    sock = None
                self.latencies.append(time.perf_counter() - start)
                self.failures += not ok
                next_at = max(next_at + self.interval, time.perf_counter())
                self._stop.wait(next_at - time.perf_counter())
        finally:
            if sock is not None:
                sock.close()

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CONNECTION_CLOSE = re.compile(rb"\r\nconnection:[^\r]*\bclose\b", re.IGNORECASE)


def read_response(sock: socket.socket) -> tuple[int, bool]:
    """Read one HTTP/1.1 answer with a Content-Length (what /health answers carry) from `sock`:
    its status and whether the connection stays open. ValueError for anything else."""
    data = b""
    while (head_end := data.find(b"\r\n\r\n")) < 0:
        data += recv_some(sock)
    head = data[:head_end]
    if not head.startswith(b"HTTP/1.") or len(head) < 12:
        raise ValueError(f"not an HTTP answer: {head[:40]!r}")
    length = _CONTENT_LENGTH.search(head)
    if length is None:
        raise ValueError("an answer without Content-Length")
    while len(data) - head_end - 4 < int(length.group(1)):
        data += recv_some(sock)
    return int(head[9:12]), _CONNECTION_CLOSE.search(head) is None


def recv_some(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("the server closed the connection")
    return chunk


@dataclass
class Run:
    """One measured run (or several merged): what the report is computed from."""

    model: str
    results: list[RequestResult]
    duration_s: float
    server_metrics_delta: dict[str, float]
    health_s: list[float] = field(default_factory=list)  # /health latencies during the run
    health_failures: int = 0
    # The load generator's own CPU time during the run (its threads together): on a machine
    # shared with the server, what the client took from it.
    client_cpu_s: float = 0.0

    def report(self) -> dict[str, Any]:
        summary = summarize(self.results, self.duration_s)
        summary["model"] = self.model
        summary["client_cpu_s"] = self.client_cpu_s
        summary["server_metrics_delta"] = self.server_metrics_delta
        if self.health_s:
            ms = [v * 1000 for v in self.health_s]
            summary["health_ms"] = {
                "p50": percentile(ms, 50),
                "p99": percentile(ms, 99),
                "max": max(ms),
                "probes": len(ms),
                "failed": self.health_failures,
            }
        return {"summary": summary, "requests": [asdict(r) for r in self.results]}


def merge(parts: list[Run]) -> Run:
    """Rounds of one variant as one run: requests pooled, durations and counter deltas summed."""
    delta: dict[str, float] = {}
    for part in parts:
        for key, value in part.server_metrics_delta.items():
            delta[key] = delta.get(key, 0.0) + value
    return Run(
        parts[0].model,
        [r for part in parts for r in part.results],
        sum(part.duration_s for part in parts),
        delta,
        [h for part in parts for h in part.health_s],
        sum(part.health_failures for part in parts),
        sum(part.client_cpu_s for part in parts),
    )


async def run_workload(
    base_url: str,
    endpoint: str,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    show_progress: bool = True,
    warmup: bool = True,
    health_interval: float | None = None,
    temperature: float = 0.0,
) -> Run:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    # aiohttp for the model list and the metrics; the streamed requests go through `client`.
    client = StreamClient(base_url)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base_url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        if warmup:  # one request, not measured (first-call overheads)
            warm = RequestResult(-1)
            body = request_body(requests[0], endpoint, model, temperature)
            await send(client, path, body, warm, 0.0)
            if not warm.ok:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        before = await scrape(http, base_url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        results = [RequestResult(r.index) for r in requests]
        offsets = arrival_offsets(len(requests), request_rate, seed)
        bar = tqdm(total=len(requests), desc="requests", disable=not show_progress)
        probe = HealthProbe(f"{base_url}/health", health_interval) if health_interval else None
        t0 = time.perf_counter()
        cpu0 = time.process_time()

        async def one(req: BenchRequest, result: RequestResult, offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            body = request_body(req, endpoint, model, temperature)
            if gate is None:
                await send(client, path, body, result, t0)
            else:
                async with gate:
                    await send(client, path, body, result, t0)
            bar.update(1)

        with probe or nullcontext():
            await asyncio.gather(
                *(one(*args) for args in zip(requests, results, offsets, strict=True))
            )
            duration = time.perf_counter() - t0
            client_cpu = time.process_time() - cpu0
        bar.close()
        after = await scrape(http, base_url)
        client.close()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    health = (probe.latencies, probe.failures) if probe else ([], 0)
    return Run(model, results, duration, delta, *health, client_cpu)


async def scrape(http: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The server's cumulative vllm:* counters, when it exposes them (any vLLM-compatible one)."""
    wanted = (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
    )
    try:
        async with http.get(f"{base_url}/metrics") as response:
            text = await response.text()
    except aiohttp.ClientError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def run_once(
    args: argparse.Namespace,
    url: str,
    requests: list[BenchRequest],
    concurrency: int | None,
    seed: int,
    warmup: bool = True,
    health_interval: float | None = None,
) -> Run:
    """One run of `requests` against `url` with the command line's endpoint, rate and progress."""
    workload = run_workload(
        url,
        args.endpoint,
        requests,
        args.request_rate,
        concurrency,
        seed,
        not args.no_progress,
        warmup,
        health_interval,
        args.temperature,
    )
    # uvloop where it installs (as the server runs): the load generator's callbacks cost less.
    return uvloop.run(workload) if uvloop is not None else asyncio.run(workload)
