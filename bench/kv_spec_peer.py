"""kvpilot's FP8 KV cache and n-gram speculation beside vLLM-CPU's, served, side by side in one
run: every variant's server is up at once and the rounds alternate them (A B ... B A), each round
on new requests that every variant gets alike, so load on a shared VM falls on all of them.

`kv`: KV-cache element types. Variants `SYSTEM:DTYPE:KV` (SYSTEM kvpilot or vllm, DTYPE the
model's, KV an `--kv-cache-dtype` value; kvpilot's KV is the model's dtype unless FP8, so a
bfloat16 KV cache means a bfloat16 model).
- Throughput: each server with the default KV budget (1 GiB), `--concurrency` requests in flight
  (the synthetic workload of bench/common/dataset.py, ignore_eos), `--rounds` alternating rounds:
  output tok/s and ITL p50/p99 (each gap between streamed chunks) per variant.
- Capacity: each server again with the same `--kv-budget-bytes` (kvpilot and vLLM:
  `--kv-cache-memory-bytes`), `--capacity-prompts` requests at once; a thread samples each
  server's own /metrics every `--sample-interval` s while they run. Reported per variant: the KV
  blocks it made (vllm:cache_config_info), the largest vllm:num_requests_running, its median while
  requests still wait (the concurrency the budget holds), the largest vllm:kv_cache_usage_perc and
  the preemptions (counter delta), besides throughput. Requests are sized so that the blocks of
  `--capacity-prompts` sequences exceed the budget at every dtype.

`spec`: n-gram speculation on an input-grounded workload (bench/spec_decode.py's prompts: a
paragraph to repeat, copy or edit), greedy, until EOS or `--max-tokens`. Variants: kvpilot and vLLM
each without and with `--speculative-config` (the same JSON for both: method, k and lookup sizes).
At each concurrency C in `--concurrencies`, C requests in flight (max(C, `--min-requests`) per
round). The per-request ITL is its decode time per output token after the first, (end - first
token) / (tokens - 1), so a burst of accepted tokens counts as its tokens (a gap between chunks
does not: one chunk may carry several). Greedy texts are checked: with and without speculation
alike on each system (the run fails otherwise); kvpilot against vLLM is reported.

A server that does not start (e.g. vLLM refusing an FP8 cache on a CPU without AVX-512) is
dropped from the run; its error line and vLLM's version go in the report. vLLM runs in its own venv
(`--peer-vllm PYTHON`; /work/shared/notes/vllm-cpu-peer.md), with VLLM_CPU_OMP_THREADS_BIND = every
CPU (bench/common/peer.py's vllm_env), block size 32 on both systems.

    python bench/kv_spec_peer.py kv --peer-vllm /tmp/vllm-cpu-venv/bin/python --out bench/kv_peer
    python bench/kv_spec_peer.py spec --peer-vllm /tmp/vllm-cpu-venv/bin/python \\
        --out bench/spec_peer
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.client import RequestResult, run_once, send
from common.dataset import synthetic_dataset
from common.offline_workers import SERVED_MODEL_NAME
from common.peer import VLLM_SERVER_MODULE, bundled_hf_dir, vllm_env
from common.plotting import pyplot
from common.processes import ServerProcess, free_port, kvpilot_serve_cmd, wait_until_idle
from common.stats import median_or_none, percentile, ratio
from common.stream_client import StreamClient
from spec_decode import PARAGRAPHS, TASKS

SYSTEMS = ("kvpilot", "vllm")
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only
KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:generation_tokens_total",
)
_ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")


@dataclass(frozen=True)
class Variant:
    """One server configuration: a system, the model's dtype, the KV cache's and speculation."""

    system: str
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    speculative: bool = False

    @property
    def name(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f" kv {self.kv_cache_dtype}"
        return f"{self.system} {self.dtype}{kv}{' ngram' if self.speculative else ''}"


def parse_kv_variants(text: str) -> list[Variant]:
    """`SYSTEM:DTYPE:KV,...` (ValueError naming the bad item)."""
    variants = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[0] not in SYSTEMS or parts[1] not in ("float32", "bfloat16"):
            raise ValueError(
                f"a variant is SYSTEM:DTYPE:KV (kvpilot|vllm, float32|bfloat16), {item!r}"
            )
        if parts[2] not in KV_DTYPES:
            raise ValueError(f"KV must be one of {', '.join(KV_DTYPES)}, got {parts[2]!r}")
        variants.append(Variant(parts[0], parts[1], parts[2]))
    if len(set(variants)) != len(variants):
        raise ValueError("a variant is listed twice")
    return variants


def server_cmd(
    variant: Variant,
    vllm_python: str,
    hf_dir: str,
    port: int,
    budget_bytes: int | None,
    spec_json: str,
    vllm_args: str = "",
) -> list[str]:
    """The server command line of `variant` (kvpilot on its own free port, vLLM on `port`)."""
    common = ["--dtype", variant.dtype, "--block-size", str(BLOCK_SIZE)]
    common += ["--kv-cache-dtype", variant.kv_cache_dtype]
    if budget_bytes is not None:
        common += ["--kv-cache-memory-bytes", str(budget_bytes)]
    if variant.speculative:
        common += ["--speculative-config", spec_json]
    if variant.system == "kvpilot":
        return kvpilot_serve_cmd(common)
    return [
        vllm_python, "-m", VLLM_SERVER_MODULE, "--model", hf_dir,
        "--served-model-name", SERVED_MODEL_NAME, "--enable-prompt-tokens-details",
        "--host", "127.0.0.1", "--port", str(port), *common, *shlex.split(vllm_args),
    ]  # fmt: skip


def error_line(log_text: str) -> str:
    """The first `SomethingError: message` line of a failed server's log outside its warnings
    (the root cause; later ones re-raise it), '' when none."""
    for line in log_text.splitlines():
        if "WARNING" not in line and (m := _ERROR_LINE.search(line)):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return ""


class Fleet:
    """Every variant's server, started at once; those that fail to start are dropped, their error
    kept in `refused`."""

    def __init__(
        self,
        variants: list[Variant],
        args: argparse.Namespace,
        logs: Path,
        tag: str,
        budget_bytes: int | None = None,
    ) -> None:
        self.servers: dict[Variant, ServerProcess] = {}
        self.urls: dict[Variant, str] = {}
        self.refused: dict[str, str] = {}
        self.commands: dict[str, str] = {}
        hf_dir = bundled_hf_dir()
        env = vllm_env(args.peer_vllm, [])
        if budget_bytes is not None:  # the flag sets vLLM's budget; this variable would win
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        for v in variants:
            port = free_port()
            cmd = server_cmd(
                v, args.peer_vllm, hf_dir, port, budget_bytes, args.spec_config, args.vllm_args
            )
            log = logs / f"{tag}-{v.name.replace(' ', '_')}.log"
            vllm = v.system == "vllm"
            self.servers[v] = ServerProcess(
                v.name, cmd, "/health" if vllm else "/ready", port=port if vllm else None,
                env=env if vllm else None, log=log,
            )  # fmt: skip
            self.commands[v.name] = shlex.join(cmd)
        for v, server in list(self.servers.items()):
            try:
                self.urls[v] = server.wait_ready()
            except RuntimeError as exc:
                time.sleep(1)  # the log reader's last lines
                text = server.log.read_text(errors="replace") if server.log else ""
                self.refused[v.name] = error_line(text) or str(exc)
                print(f"{v.name} did not start: {self.refused[v.name]}", flush=True)
                server.stop()
                del self.servers[v]

    @property
    def variants(self) -> list[Variant]:
        return list(self.urls)

    def pgids(self) -> list[int]:
        return [s.proc.pid for s in self.servers.values()]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def round_order(variants: list[Variant], r: int) -> list[Variant]:
    """A B ... in even rounds, ... B A in odd ones."""
    return list(variants) if r % 2 == 0 else list(reversed(variants))


def parse_metrics(text: str) -> dict[str, float]:
    """The gauges and counters this script reads, summed over their labels; cache_config_info's
    num_gpu_blocks label as `num_gpu_blocks`."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in GAUGES or name in COUNTERS:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        elif name == "vllm:cache_config_info" and (m := re.search(r'num_gpu_blocks="(\d+)"', line)):
            values["num_gpu_blocks"] = float(m.group(1))
    return values


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


class MetricsSampler:
    """GETs a server's /metrics every `interval` s on its own thread while a run is in flight."""

    def __init__(self, url: str, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    self.samples.append(parse_metrics(http.get(f"{self.url}/metrics").text))
                self._stop.wait(self.interval)

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def capacity_figures(samples: list[dict[str, float]]) -> dict[str, Any]:
    """What the samples of one capacity run show: the most sequences running at once, the median
    running while requests still waited (what the budget holds under backlog) and the most KV
    in use."""
    running = [s.get("vllm:num_requests_running", 0.0) for s in samples]
    backlog = [
        s.get("vllm:num_requests_running", 0.0)
        for s in samples
        if s.get("vllm:num_requests_waiting", 0.0) > 0
    ]
    usage = [s.get("vllm:kv_cache_usage_perc", 0.0) for s in samples]
    return {
        "samples": len(samples),
        "max_running": max(running, default=0.0),
        "median_running_while_waiting": statistics.median(backlog) if backlog else None,
        "max_kv_cache_usage": max(usage, default=0.0),
    }


def kv_run(args: argparse.Namespace, fleet: Fleet, r: int, seed: int, phase: str) -> list[dict]:
    """Round r of one phase: every variant on the same requests, in the round's order."""
    capacity = phase == "capacity"
    n = args.capacity_prompts if capacity else args.num_prompts
    requests = synthetic_dataset(
        n, args.input_len, args.output_len, args.range_ratio, 0, seed
    )  # fmt: skip
    conc = n if capacity else args.concurrency
    records = []
    for v in round_order(fleet.variants, r):
        settle = wait_until_idle(fleet.pgids())
        url = fleet.urls[v]
        before = scrape(url)
        with MetricsSampler(url, args.sample_interval) as sampler:
            run = run_once(args, url, requests, conc, seed, warmup=False)
        after = scrape(url)
        s = run.report()["summary"]
        record = {
            "phase": phase,
            "round": r + 1,
            "seed": seed,
            "variant": v.name,
            "out_tok_s": s["output_throughput"],
            "itl_p50_ms": s["itl_ms"]["p50"],
            "itl_p99_ms": s["itl_ms"]["p99"],
            "ttft_p50_ms": s["ttft_ms"]["p50"],
            "failed": s["failed"],
            "output_tokens": s["total_output_tokens"],
            "settle_s": settle,
            "preemptions": after.get("vllm:num_preemptions_total", 0.0)
            - before.get("vllm:num_preemptions_total", 0.0),
            "num_gpu_blocks": after.get("num_gpu_blocks"),
            **capacity_figures(sampler.samples),
        }
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


def summarize_kv(records: list[dict], reference: str | None) -> dict[str, dict[str, Any]]:
    """Per phase and variant: medians over rounds, and the median of the per-round ratios of out
    tok/s (and of ITL p50, reference / variant: > 1 is faster) against `reference`."""
    out: dict[str, dict[str, Any]] = {}
    for phase in sorted({r["phase"] for r in records}):
        rows = [r for r in records if r["phase"] == phase]
        names = list(dict.fromkeys(r["variant"] for r in rows))
        by = {(r["variant"], r["round"]): r for r in rows}
        rounds = sorted({r["round"] for r in rows})
        table = {}
        for name in names:
            mine = [r for r in rows if r["variant"] == name]
            entry: dict[str, Any] = {
                k: median_or_none([r[k] for r in mine])
                for k in ("out_tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms")
            }
            entry["failed"] = sum(r["failed"] for r in mine)
            entry["preemptions"] = sum(r["preemptions"] for r in mine)
            entry["num_gpu_blocks"] = mine[-1]["num_gpu_blocks"]
            entry["max_running"] = max(r["max_running"] for r in mine)
            entry["median_running_while_waiting"] = median_or_none(
                [r["median_running_while_waiting"] for r in mine]
            )
            entry["max_kv_cache_usage"] = max(r["max_kv_cache_usage"] for r in mine)
            if reference in names and name != reference:
                pairs = [(by.get((name, k)), by.get((reference, k))) for k in rounds]
                pairs = [(a, b) for a, b in pairs if a and b]
                entry["tok_s_ratio_rounds"] = [
                    ratio(a["out_tok_s"], b["out_tok_s"]) for a, b in pairs
                ]
                entry["tok_s_ratio"] = median_or_none(entry["tok_s_ratio_rounds"])
                entry["itl_p50_speedup"] = median_or_none(
                    [ratio(b["itl_p50_ms"], a["itl_p50_ms"]) for a, b in pairs]
                )
            table[name] = entry
        out[phase] = table
    return out


def spec_prompts(n: int, offset: int) -> list[list[dict[str, str]]]:
    """n chat requests of bench/spec_decode.py's workload, starting at workload item `offset`."""
    items = []
    for i in range(offset, offset + n):
        task = TASKS[i % len(TASKS)].format(p=PARAGRAPHS[(i // len(TASKS)) % len(PARAGRAPHS)])
        items.append([{"role": "user", "content": task}])
    return items


def request_itl(result: RequestResult) -> float | None:
    """Decode time per output token after the first (s), None below 2 tokens."""
    return result.tpot if result.ok else None


async def spec_workload(
    url: str, messages: list[list[dict[str, str]]], concurrency: int, max_tokens: int
) -> tuple[list[RequestResult], float]:
    client = StreamClient(url)
    gate = asyncio.Semaphore(concurrency)
    results = [RequestResult(i) for i in range(len(messages))]
    t0 = time.perf_counter()

    async def one(msgs: list[dict[str, str]], result: RequestResult) -> None:
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": msgs,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with gate:
            await send(client, "/v1/chat/completions", body, result, t0)

    await asyncio.gather(*(one(m, r) for m, r in zip(messages, results, strict=True)))
    duration = time.perf_counter() - t0
    client.close()
    return results, duration


async def greedy_texts(url: str, messages: list[list[dict[str, str]]], max_tokens: int) -> list:
    async with httpx.AsyncClient(timeout=600) as http:

        async def one(msgs: list[dict[str, str]]) -> str:
            body = {
                "model": SERVED_MODEL_NAME,
                "messages": msgs,
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            answer = await http.post(f"{url}/v1/chat/completions", json=body)
            answer.raise_for_status()
            return answer.json()["choices"][0]["message"]["content"]

        return list(await asyncio.gather(*(one(m) for m in messages)))


def spec_run(
    args: argparse.Namespace, fleet: Fleet, conc: int, r: int, offset: int
) -> list[dict[str, Any]]:
    n = max(conc, args.min_requests)
    messages = spec_prompts(n, offset)
    records = []
    for v in round_order(fleet.variants, r):
        settle = wait_until_idle(fleet.pgids())
        url = fleet.urls[v]
        before = scrape(url)
        results, duration = asyncio.run(spec_workload(url, messages, conc, args.max_tokens))
        after = scrape(url)
        itls = [t for res in results if (t := request_itl(res)) is not None]
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
        tokens = sum(res.output_tokens for res in results if res.ok)
        record = {
            "concurrency": conc,
            "round": r + 1,
            "variant": v.name,
            "requests": n,
            "failed": sum(not res.ok for res in results),
            "output_tokens": tokens,
            "out_tok_s": tokens / duration,
            "itl_mean_ms": 1000 * statistics.fmean(itls) if itls else None,
            "itl_p50_ms": 1000 * percentile(itls, 50) if itls else None,
            "itl_p99_ms": 1000 * percentile(itls, 99) if itls else None,
            "drafts": delta["vllm:spec_decode_num_drafts_total"],
            "draft_tokens": delta["vllm:spec_decode_num_draft_tokens_total"],
            "accepted_tokens": delta["vllm:spec_decode_num_accepted_tokens_total"],
            "settle_s": settle,
        }
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


SPEC_NAMES = {(s, sp): Variant(s, speculative=sp).name for s in SYSTEMS for sp in (False, True)}
# The summary's ratios: name -> (a, b), the paired-round median of b's ITL / a's.
SPEC_RATIOS = {
    "kvpilot_ngram_speedup": (("kvpilot", True), ("kvpilot", False)),
    "vllm_ngram_speedup": (("vllm", True), ("vllm", False)),
    "kvpilot_vs_vllm_ngram": (("kvpilot", True), ("vllm", True)),
    "kvpilot_vs_vllm_plain": (("kvpilot", False), ("vllm", False)),
}


def paired_itl_ratio(rows: list[dict], a: str, b: str) -> float | None:
    """Median over the rounds both ran of b's mean ITL / a's (> 1: a is faster)."""
    by = {(r["variant"], r["round"]): r for r in rows}
    values = []
    for k in sorted({r["round"] for r in rows}):
        ra, rb = by.get((a, k)), by.get((b, k))
        if ra and rb and ra["itl_mean_ms"] and rb["itl_mean_ms"]:
            values.append(rb["itl_mean_ms"] / ra["itl_mean_ms"])
    return median_or_none(values)


def summarize_spec(records: list[dict]) -> dict[str, dict[str, Any]]:
    """Per concurrency and variant: mean-ITL median over rounds and acceptance; per concurrency
    the paired-round ratios: speculation's ITL speedup on each system (plain / ngram) and kvpilot
    ngram's against vLLM ngram's (vLLM's ITL / kvpilot's: > 1 is kvpilot faster)."""
    out: dict[str, dict[str, Any]] = {}
    for conc in sorted({r["concurrency"] for r in records}):
        rows = [r for r in records if r["concurrency"] == conc]
        table: dict[str, Any] = {}
        for name in dict.fromkeys(r["variant"] for r in rows):
            mine = [r for r in rows if r["variant"] == name]
            drafted = sum(r["draft_tokens"] for r in mine)
            table[name] = {
                "itl_ms": median_or_none([r["itl_mean_ms"] for r in mine]),
                "itl_p99_ms": median_or_none([r["itl_p99_ms"] for r in mine]),
                "out_tok_s": median_or_none([r["out_tok_s"] for r in mine]),
                "failed": sum(r["failed"] for r in mine),
                "acceptance": (sum(r["accepted_tokens"] for r in mine) / drafted)
                if drafted
                else None,
                "draft_tokens": drafted,
            }

        table["ratios"] = {
            key: paired_itl_ratio(rows, SPEC_NAMES[a], SPEC_NAMES[b])
            for key, (a, b) in SPEC_RATIOS.items()
        }
        out[str(conc)] = table
    return out


def spec_variants() -> list[Variant]:
    return [Variant(s, speculative=sp) for s in SYSTEMS for sp in (False, True)]


def parse_spec_variants(text: str) -> list[Variant]:
    """`SYSTEM` or `SYSTEM+ngram`, comma-separated (ValueError naming the bad item)."""
    variants = []
    for item in text.split(","):
        system, plus, method = item.strip().partition("+")
        if system not in SYSTEMS or (plus and method != "ngram"):
            raise ValueError(f"a spec variant is kvpilot|vllm, optionally +ngram; got {item!r}")
        variants.append(Variant(system, speculative=bool(plus)))
    return variants


def vllm_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}


def plot_kv(
    summary: dict[str, dict[str, Any]], path: Path, throughput_budget_bytes: int | None
) -> None:
    """One panel per measure the run has: throughput and ITL, and capacity when it ran."""
    plt = pyplot()
    tp = summary.get("throughput", {})
    cap = summary.get("capacity", {})
    panels = (["throughput", "itl"] if tp else []) + (["capacity"] if cap else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    ax_of = dict(zip(panels, axes[0], strict=True))
    names = list(tp)
    if tp:
        budget = (
            f"{throughput_budget_bytes / 2**20:.0f} MiB of KV each"
            if throughput_budget_bytes
            else "each system's default KV budget"
        )
        ax = ax_of["throughput"]
        ax.bar(names, [tp[n]["out_tok_s"] or 0 for n in names], color="tab:blue")
        ax.set_ylabel("output tok/s (median of rounds)")
        ax.set_title(f"throughput, {budget}")
        x = range(len(names))
        ax = ax_of["itl"]
        ax.bar([i - 0.2 for i in x], [tp[n]["itl_p50_ms"] or 0 for n in names], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [tp[n]["itl_p99_ms"] or 0 for n in names], 0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ITL (ms)")
        ax.set_title("inter-token latency")
        ax.legend()
    if cap:
        cnames = list(cap)
        ax = ax_of["capacity"]
        ax.bar(cnames, [cap[n]["max_running"] for n in cnames], color="tab:green")
        ax.set_ylabel("max vllm:num_requests_running")
        ax.set_title("sequences running at once, fixed KV budget")
    for ax in axes[0]:
        ax.tick_params(axis="x", labelrotation=30, labelsize="small")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_spec(summary: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    concs = list(summary)
    names = [v.name for v in spec_variants()]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [(summary[c].get(name) or {}).get("itl_ms") or 0 for c in concs]
        ax.bar([j + (i - 1.5) * width for j in range(len(concs))], ys, width, label=name)
    ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
    ax.set_yscale("log")
    ax.set_ylabel("ITL per request, ms (median of rounds, log)")
    ax.set_title("n-gram speculation on an input-grounded workload, kvpilot and vLLM-CPU")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(report: dict[str, Any], out: str) -> None:
    Path(out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")


def cmd_kv(args: argparse.Namespace) -> int:
    variants = parse_kv_variants(args.variants)
    logs = Path(str(args.out) + "-logs")
    report: dict[str, Any] = {
        "command": "python bench/kv_spec_peer.py " + shlex.join(sys.argv[1:]),
        "vllm_version": vllm_version(args.peer_vllm),
        "machine": machine(),
        "records": [],
        "refused": {},
        "commands": {},
    }
    phases = (("throughput", args.throughput_budget_bytes), ("capacity", args.kv_budget_bytes))
    for phase, budget in phases:
        if phase not in args.phases.split(","):
            continue
        # A variant refused in the first phase is not started again.
        refused = {k.split(": ", 1)[1] for k in report["refused"]}
        fleet = Fleet([v for v in variants if v.name not in refused], args, logs, phase, budget)
        try:
            report["refused"].update({f"{phase}: {k}": e for k, e in fleet.refused.items()})
            report["commands"][phase] = fleet.commands
            for v in fleet.variants:  # unmeasured: first-call overheads
                warm = synthetic_dataset(4, args.input_len, 8, 0.0, 0, 999_999)
                run_once(args, fleet.urls[v], warm, 4, 999_999, warmup=False)
            rounds = args.rounds if phase == "throughput" else args.capacity_rounds
            for r in range(rounds):
                report["records"] += kv_run(args, fleet, r, args.seed + r, phase)
                save(report, args.out)  # what has run so far, should a later part fail
        finally:
            fleet.stop()
    report["machine"]["loadavg_end"] = os.getloadavg()
    reference = Variant("vllm", "float32", "auto").name
    report["summary"] = summarize_kv(report["records"], reference)
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    plot_kv(report["summary"], Path(args.out).with_suffix(".png"), args.throughput_budget_bytes)
    print(json.dumps(report["summary"], indent=1))
    return 0 if all(r["failed"] == 0 for r in report["records"]) else 1


def cmd_spec(args: argparse.Namespace) -> int:
    concs = [int(c) for c in args.concurrencies.split(",")]
    logs = Path(str(args.out) + "-logs")
    report: dict[str, Any] = {
        "command": "python bench/kv_spec_peer.py " + shlex.join(sys.argv[1:]),
        "vllm_version": vllm_version(args.peer_vllm),
        "machine": machine(),
        "speculative_config": args.spec_config,
        "records": [],
    }
    fleet = Fleet(parse_spec_variants(args.variants), args, logs, "spec")
    report["refused"], report["commands"] = fleet.refused, fleet.commands
    status = 0
    try:
        check = spec_prompts(len(PARAGRAPHS) * len(TASKS), 0)
        texts = {
            v.name: asyncio.run(greedy_texts(fleet.urls[v], check, args.max_tokens))
            for v in fleet.variants
        }  # fmt: skip  (also the warm-up)
        same = {
            system: texts[f"{system} float32"] == texts[f"{system} float32 ngram"]
            for system in SYSTEMS
            if f"{system} float32" in texts and f"{system} float32 ngram" in texts
        }
        theirs = texts.get("vllm float32") or texts.get("vllm float32 ngram") or []
        across = [a == b for a, b in zip(texts.get("kvpilot float32", []), theirs, strict=False)]
        report["greedy"] = {"same_with_speculation": same, "kvpilot_equals_vllm": across}
        print(json.dumps(report["greedy"]), flush=True)
        if not all(same.values()):
            print("greedy outputs differ with speculation", file=sys.stderr)
            status = 1
        for conc in concs:
            for r in range(args.rounds):
                report["records"] += spec_run(args, fleet, conc, r, offset=r * 7)
                save(report, args.out)  # what has run so far, should a later part fail
    finally:
        fleet.stop()
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["summary"] = summarize_spec(report["records"])
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    plot_spec(report["summary"], Path(args.out).with_suffix(".png"))
    print(json.dumps(report["summary"], indent=1))
    return status or int(any(r["failed"] for r in report["records"]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    kv = sub.add_parser("kv", help="FP8 / bfloat16 / float32 KV: throughput and capacity")
    spec = sub.add_parser("spec", help="n-gram speculation with and without, both systems")
    for s in (kv, spec):
        s.add_argument("--peer-vllm", metavar="PYTHON", default="/tmp/vllm-cpu-venv/bin/python")
        s.add_argument("--out", default="bench/out/kv_spec_peer", help="writes OUT.json, OUT.png")
        s.add_argument("--spec-config", default=DEFAULT_SPEC, help="--speculative-config JSON")
        s.add_argument(
            "--vllm-args",
            default="",
            help="extra vLLM server flags, e.g. --enforce-eager (no minute-long compile at start)",
        )
        s.add_argument("--no-progress", action="store_true", default=True)
        s.add_argument("--endpoint", default="completions", help=argparse.SUPPRESS)
        s.add_argument("--request-rate", type=float, default=float("inf"), help=argparse.SUPPRESS)
        s.add_argument("--temperature", type=float, default=0.0, help=argparse.SUPPRESS)
    kv.add_argument(
        "--variants",
        default="kvpilot:float32:auto,kvpilot:float32:fp8_e4m3,kvpilot:bfloat16:auto,"
        "vllm:float32:auto,vllm:float32:fp8_e4m3",
        help="SYSTEM:DTYPE:KV,...",
    )
    kv.add_argument("--concurrency", type=int, default=64)
    kv.add_argument("--num-prompts", type=int, default=64, help="per throughput round")
    kv.add_argument("--input-len", type=int, default=160, help="words (about tokens)")
    kv.add_argument("--output-len", type=int, default=64)
    kv.add_argument("--range-ratio", type=float, default=0.25)
    kv.add_argument("--rounds", type=int, default=2, help="throughput rounds (A B B A)")
    kv.add_argument("--seed", type=int, default=0)
    kv.add_argument(
        "--kv-budget-bytes",
        type=int,
        default=189 * 1024 * 1024,
        help="capacity phase KV budget; default: ~32 bfloat16 sequences of ~250 tokens (SmolLM2)",
    )
    kv.add_argument(
        "--throughput-budget-bytes",
        type=int,
        default=None,
        help="throughput phase KV budget on both systems (default: each system's, 1 GiB)",
    )
    kv.add_argument("--capacity-prompts", type=int, default=128)
    kv.add_argument("--capacity-rounds", type=int, default=1)
    kv.add_argument("--sample-interval", type=float, default=0.25, help="s between /metrics")
    kv.add_argument("--phases", default="throughput,capacity", help="comma-separated")
    spec.add_argument("--concurrencies", default="1,8,64")
    spec.add_argument(
        "--variants", default="kvpilot,kvpilot+ngram,vllm,vllm+ngram", help="comma-separated"
    )
    spec.add_argument("--rounds", type=int, default=2)
    spec.add_argument("--max-tokens", type=int, default=64)
    spec.add_argument(
        "--min-requests", type=int, default=4, help="requests per round at least (c=1: in turn)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    return cmd_kv(args) if args.what == "kv" else cmd_spec(args)


if __name__ == "__main__":
    sys.exit(main())
