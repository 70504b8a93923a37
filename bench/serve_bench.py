"""Serving benchmark for any OpenAI-compatible server, in the manner of `vllm bench serve`.

Sends a synthetic workload over HTTP (streaming), measures on the client side, and reports request
and output-token throughput and TTFT / ITL / TPOT / end-to-end latency (mean, p50, p99); writes a
JSON file (configuration, summary, every request) and a PNG.

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

    python bench/serve_bench.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    python bench/serve_bench.py --launch --ab-prefix-caching --endpoint chat --prefix-len 1024 \\
        --input-len 32 --output-len 16 --num-prompts 12 --max-concurrency 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

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


def request_body(req: BenchRequest, endpoint: str, model: str) -> dict[str, Any]:
    common = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        messages = [{"role": "user", "content": req.text}]
        if req.prefix:
            messages.insert(0, {"role": "system", "content": req.prefix})
        return {**common, "messages": messages}
    prompt = f"{req.prefix} {req.text}" if req.prefix else req.text
    return {**common, "prompt": prompt}


async def send(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult, t0: float
) -> None:
    start = time.perf_counter()
    result.start = start - t0
    last = start
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.ttft > 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)


@dataclass
class Run:
    """One measured run (or several merged): what the report is computed from."""

    model: str
    results: list[RequestResult]
    duration_s: float
    server_metrics_delta: dict[str, float]

    def report(self) -> dict[str, Any]:
        summary = summarize(self.results, self.duration_s)
        summary["model"] = self.model
        summary["server_metrics_delta"] = self.server_metrics_delta
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
) -> Run:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits()) as http:
        model = (await http.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        if warmup:  # one request, not measured (first-call overheads)
            warm = RequestResult(-1)
            body = request_body(requests[0], endpoint, model)
            await send(http, base_url + path, body, warm, 0.0)
            if not warm.ok:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        before = await scrape(http, base_url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        results = [RequestResult(r.index) for r in requests]
        offsets = arrival_offsets(len(requests), request_rate, seed)
        bar = tqdm(total=len(requests), desc="requests", disable=not show_progress)
        t0 = time.perf_counter()

        async def one(req: BenchRequest, result: RequestResult, offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            body = request_body(req, endpoint, model)
            if gate is None:
                await send(http, base_url + path, body, result, t0)
            else:
                async with gate:
                    await send(http, base_url + path, body, result, t0)
            bar.update(1)

        await asyncio.gather(*(one(*args) for args in zip(requests, results, offsets, strict=True)))
        duration = time.perf_counter() - t0
        bar.close()
        after = await scrape(http, base_url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return Run(model, results, duration, delta)


async def scrape(http: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The server's cumulative vllm:* counters, when it exposes them (any vLLM-compatible one)."""
    wanted = (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
    )
    try:
        text = (await http.get(f"{base_url}/metrics")).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


@contextmanager
def launched_server(serve_args: list[str]) -> Iterator[str]:
    """`kvpilot serve --port 0 ...` as a subprocess; yields its base URL once /ready is 200."""
    cmd = [sys.executable, "-m", "kvpilot.engine.cli", "serve", "--port", "0", *serve_args]
    print("launching:", shlex.join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    port: list[int] = []

    def read_log() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if found := re.search(r"Uvicorn running on http://[\d.]+:(\d+)", line):
                port.append(int(found.group(1)))
            if " ERROR " in line or "Traceback" in line:
                sys.stderr.write(line)

    threading.Thread(target=read_log, daemon=True).start()
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvpilot serve exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("kvpilot serve did not become ready in 600 s")
            if port:
                try:
                    if httpx.get(f"http://127.0.0.1:{port[0]}/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


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
    p.add_argument("--output-len", type=int, default=32, help="mean output length (tokens)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths are uniform in +-ratio")
    p.add_argument("--prefix-len", type=int, default=0, help="shared prefix length (words)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate (req/s)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/serve_bench", help="writes OUT.json and OUT.png")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ab_prefix_caching and not args.launch:
        print("--ab-prefix-caching needs --launch (it starts both servers)", file=sys.stderr)
        return 2
    if args.ab_rounds < 1 or args.num_prompts < 1:
        print("--ab-rounds and --num-prompts must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.range_ratio < 1:
        print("--range-ratio must be in [0, 1)", file=sys.stderr)
        return 2
    requests = synthetic_dataset(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.prefix_len,
        args.seed,
    )  # fmt: skip

    def run_against(url: str, part: list[BenchRequest], warmup: bool = True) -> Run:
        workload = run_workload(
            url,
            args.endpoint,
            part,
            args.request_rate,
            args.max_concurrency,
            args.seed,
            not args.no_progress,
            warmup,
        )
        return asyncio.run(workload)

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
