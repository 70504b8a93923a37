"""Tenants through `kvpilot router`: priority under a burst, fair shares, a quota across two
routers, and the latency tenancy adds. One case per subcommand; each writes
bench/tenancy_<case>.json and .png (`--out-dir` elsewhere) and prints its progress.

Every case but `overhead` runs one `kvpilot serve` of the bundled SmolLM2 (`--scheduling-policy
priority`, `--max-num-seqs` as given) and a redis-server of its own on loopback; tenants are
Tenant + Secret manifests in a `--tenants-file`; the routers share the redis-server's counters
(`--quota-store-url`). Content chunks are counted as tokens (the engine streams one token per
chunk; each request's usage is recorded next to its count).

- `priority`: a premium tenant (class critical) sends one short chat request (max_tokens 16)
  every `--premium-interval` s, steadily: from `--premium-lead-s` before the burst (those not
  counted), or, with 0, from `--burst-lead-s` after it; the TTFT of those sent from the burst
  on, per phase, all on the same engine in the same run:
  (1) alone, through the tenancy router; (2) while a best-effort tenant bursts `--burst`
  concurrent streams (max_tokens `--burst-max-tokens`, ignore_eos) through the tenancy router
  (fair queue + engine priority), replica concurrency as the engine reports it; (3) `knob`: the
  same through a tenancy router with `--replica-concurrency` `--knob-rc` (it bounds the
  best-effort requests in flight; the critical class only by the engine's max_num_seqs); (4)
  `fcfs`: the same burst
  through a router without tenancy; `undeclared`: as (2) through a tenancy router run with
  `--guard-memory 0` (it never declares the premium class to the engine, whose guard then acts
  only once it has seen a premium request). `--phases` picks which (alone first: the ratios
  are to it). The router's fair-queue wait per tenant (its
  kvpilot_router_tenant_queue_seconds) is recorded per phase.
  Each phase counts premium requests for `--phase-s`; the burst is cancelled once the premium
  requests of the phase have their answers. The load generator's event-loop lag and the load
  average are recorded per phase (a TTFT measured here includes the former), and the burst
  streams' gaps between chunks (the engine's step time while the premium requests join it).
- `fairness`: three standard tenants with `--clients` concurrent streams each (max_tokens
  `--max-tokens`, ignore_eos), router `--replica-concurrency` small so the fair queue decides;
  weights 1:1:1, then 2:1:1 (a fresh router each); tokens per tenant in the steady window
  [`--warmup-s`, `--phase-s`); Jain's index of share_i / weight_i.
- `quota`: one tenant with tokensPerMinute `--tokens-per-minute`, two routers on one
  redis-server, `--clients` clients each sending its requests to the routers in turn; starts at
  a window's start (windows are fixed minutes of the wall clock), stops sending `--stop-before-s`
  before its end; tokens served in the window (usage: prompt + completion) against the quota,
  and the 429s with their Retry-After.
- `overhead`: a non-stream completion (token-id prompt, max_tokens 1) to a stand-in engine
  (aiohttp on loopback, answering at once: the engine's variance would drown a millisecond)
  straight, through a router without tenancy, and through a router with tenancy as a tenant with
  a quota (Redis store) and as one without, the four alternating request by request
  (`--samples` each), `--repeats` times; p50 and p99 of each, and per repeat. After each repeat,
  per router variant a block of `--cpu-requests` requests and the router process's CPU time over
  it (and redis-server's), from /proc: CPU per request, which a loaded machine does not inflate
  as it does latency.

    python bench/tenancy.py priority
    python bench/tenancy.py fairness
    python bench/tenancy.py quota
    python bench/tenancy.py overhead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from common.plotting import pyplot
from common.processes import ServerProcess, kvpilot_serve_cmd, wait_until_idle
from common.stats import percentile
from common.stream_client import StreamClient
from common.tenants import (
    RedisProcess,
    Reply,
    TenantDef,
    jain,
    start_router,
    stream_chat,
    write_tenants,
)

MODEL = "bench"
BENCH = Path(__file__).resolve().parent
_WORD_LIST = (
    "account billing booking customer delivery discount engine feature garden holiday invoice "
    "kitchen license manager market member network office order payment policy premium printer "
    "product refund region rental repair return route schedule service shipping station support"
)
WORDS = tuple(_WORD_LIST.split())


def question(rng: random.Random, words: int = 16) -> str:
    return "Question: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "?"


def chat_body(content: str, max_tokens: int, ignore_eos: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
    }


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 1)


class Platform:
    """The engine, a redis-server and the routers a case starts; stop() ends them all."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.processes: list[ServerProcess] = []
        self.redis: RedisProcess | None = None
        self.engine_url = ""

    def start_engine(self, args: argparse.Namespace) -> str:
        serve_args = ["--served-model-name", MODEL, "--max-num-seqs", str(args.max_num_seqs)]
        serve_args += ["--scheduling-policy", "priority", "--max-model-len", "1024"]
        if args.max_num_batched_tokens:
            serve_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        serve_args += args.engine_arg
        if args.engine_cpu is not None:
            serve_args += ["--engine-cpus", str(args.engine_cpu)]
        cmd = kvpilot_serve_cmd(serve_args)
        # One torch thread: the engine has one core, the routers, redis and the clients the
        # other (two engines' thread pools spinning against each other on a shared 2-core VM
        # made each step many times slower).
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        engine = ServerProcess(
            "kvpilot serve", cmd, "/ready", env=env, log=self.work / "engine.log"
        )
        self.processes.append(engine)
        self.engine_url = engine.wait_ready()
        log(f"engine ready at {self.engine_url}")
        if args.engine_cpu is not None:
            # Everything started from here on (routers, redis-server, this load generator)
            # runs beside the engine core's CPU, never on it, as a pod's guaranteed CPUs would.
            others = os.sched_getaffinity(0) - {args.engine_cpu}
            os.sched_setaffinity(0, others)
            log(f"engine core on CPU {args.engine_cpu}; the rest on CPUs {sorted(others)}")
        return self.engine_url

    def start_redis(self) -> str:
        self.redis = RedisProcess(self.work / "redis")
        return self.redis.url

    def router(
        self,
        name: str,
        args: list[str],
        engine_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        process, url = start_router(
            name, MODEL, engine_url or self.engine_url, args, self.work / f"{name}.log", env
        )
        self.processes.append(process)
        log(f"router {name} ready at {url}: {' '.join(args)}")
        return url

    def process_at(self, url: str) -> ServerProcess:
        """The process serving `url` (one this platform started)."""
        for process in self.processes:
            if process.port and url.endswith(f":{process.port[0]}"):
                return process
        raise KeyError(url)

    def stop_router(self, url: str) -> None:
        process = self.process_at(url)
        process.stop()
        self.processes.remove(process)

    def engine_pgid(self) -> int:
        return self.processes[0].proc.pid

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        if self.redis is not None:
            self.redis.stop()


async def wait_tokenizer(url: str, key: str | None) -> None:
    """The router counts a chat's prompt tokens with the model's tokenizer, which it loads in
    the background: wait for it, so that no phase pays its load."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(600):
            info = (await http.get(f"{url}/v1/models/{MODEL}", headers=headers)).json()
            if info.get("kvpilot", {}).get("tokenizerLoaded", True):
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not load the tokenizer")


async def queue_seconds(url: str) -> dict[str, tuple[float, float]]:
    """The router's fair-queue wait per tenant so far (kvpilot_router_tenant_queue_seconds):
    tenant -> (sum of seconds, requests). Empty for a router without tenancy."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{url}/metrics")).text
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kvpilot_router_tenant_queue_seconds":
            continue
        for sample in family.samples:
            entry = found.setdefault(sample.labels.get("tenant", ""), [0.0, 0.0])
            if sample.name.endswith("_sum"):
                entry[0] = sample.value
            elif sample.name.endswith("_count"):
                entry[1] = sample.value
    return {tenant: (total, count) for tenant, (total, count) in found.items()}


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "note": "2-core development VM, shared with other engineers' work while it ran",
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
    log(f"wrote {path}")


# ---- priority ----


def send_premium(
    url: str,
    key: str | None,
    args: argparse.Namespace,
    rng: random.Random,
    burst_now: threading.Event,
) -> tuple[list[Reply], float, float]:
    """The premium tenant's steady traffic, in this thread's own event loop: from
    --premium-lead-s before the burst (not counted; burst_now is set when the burst is due), or
    from --burst-lead-s after it. Its counted replies, when the burst started and when they
    ended (perf_counter)."""

    async def run() -> tuple[list[Reply], float, float]:
        client = StreamClient(url)
        premium: list[asyncio.Task[Reply]] = []

        def send() -> None:
            body = chat_body(question(rng, 8), 16)
            premium.append(asyncio.create_task(stream_chat(client, body, key)))

        lead_started = time.perf_counter()
        while time.perf_counter() - lead_started < args.premium_lead_s:
            send()
            await asyncio.sleep(args.premium_interval)
        started = time.perf_counter()
        lead_in = len(premium)
        burst_now.set()
        if not args.premium_lead_s:
            await asyncio.sleep(args.burst_lead_s)  # the burst reaches the router first
        while time.perf_counter() - started < args.phase_s:
            send()
            await asyncio.sleep(args.premium_interval)
        replies = (await asyncio.gather(*premium))[lead_in:]
        client.close()
        return replies, started, time.perf_counter()

    return asyncio.run(run())


async def priority_phase(
    name: str,
    url: str,
    burst: bool,
    premium_key: str | None,
    burst_key: str | None,
    args: argparse.Namespace,
    round_index: int = 0,
) -> dict[str, Any]:
    # Each round's prompts are new (a repeated prompt would hit the prefix cache).
    rng = random.Random(f"{args.seed}/{name}/{round_index}")
    queued_before = await queue_seconds(url)
    load_before = os.getloadavg()[0]
    lags: list[float] = []
    lag_task = asyncio.create_task(loop_lag(lags))
    client = StreamClient(url)
    burst_replies: list[Reply] = []
    burst_tasks: list[asyncio.Task[Reply]] = []
    # The premium tenant is another client than the bursting one: its requests go out from a
    # thread and event loop of their own, never queued behind the burst's sends in this one.
    burst_now = threading.Event()
    premium_rng = random.Random(f"{args.seed}/{name}/{round_index}/premium")
    premium_traffic = asyncio.get_running_loop().run_in_executor(
        None, send_premium, url, premium_key, args, premium_rng, burst_now
    )
    await asyncio.to_thread(burst_now.wait)
    if burst:
        for _ in range(args.burst):
            reply = Reply()
            burst_replies.append(reply)
            body = chat_body(question(rng), args.burst_max_tokens, ignore_eos=True)
            burst_tasks.append(asyncio.create_task(stream_chat(client, body, burst_key, reply)))
    replies, started, premium_end = await premium_traffic
    for task in burst_tasks:
        task.cancel()
    await asyncio.gather(*burst_tasks, return_exceptions=True)
    lag_task.cancel()
    client.close()
    queued_after = await queue_seconds(url)
    queued = {
        tenant: {
            "requests": count - queued_before.get(tenant, (0.0, 0.0))[1],
            "mean_ms": ms(
                (total - queued_before.get(tenant, (0.0, 0.0))[0])
                / max(1.0, count - queued_before.get(tenant, (0.0, 0.0))[1])
            ),
        }
        for tenant, (total, count) in queued_after.items()
    }
    ttfts = [r.ttft for r in replies if r.status == 200 and r.ttft is not None]
    refused = [r.status for r in replies if r.status != 200]
    # The burst's step time while premium requests joined: gaps between consecutive chunks of
    # each burst stream inside the premium window.
    gaps = [
        b - a
        for reply in burst_replies
        for a, b in zip(reply.chunk_times, reply.chunk_times[1:], strict=False)
        if started <= a and b <= premium_end
    ]
    # A cancelled burst request has no end: it streamed until the phase ended.
    in_flight = [
        sum(
            1
            for b in burst_replies
            if b.first is not None and b.first <= sent and (b.end or premium_end) > sent
        )
        for sent in (r.sent for r in replies)
    ]
    result = {
        "phase": name,
        "premium_requests": len(replies),
        "premium_refused": refused,
        "premium_ttft_ms": [ms(t) for t in ttfts],
        "premium_ttft_p50_ms": ms(percentile(ttfts, 50)),
        "premium_ttft_p99_ms": ms(percentile(ttfts, 99)),
        "premium_ttft_max_ms": ms(max(ttfts, default=0.0)),
        "burst_requests": len(burst_replies),
        "burst_started_streaming": sum(1 for r in burst_replies if r.first is not None),
        "burst_chunks_in_window": sum(
            1 for r in burst_replies for t in r.chunk_times if started <= t <= premium_end
        ),
        "burst_refused": sum(1 for r in burst_replies if r.status not in (0, 200)),
        "burst_step_gap_p50_ms": ms(percentile(gaps, 50)) if gaps else None,
        "burst_step_gap_p99_ms": ms(percentile(gaps, 99)) if gaps else None,
        "burst_streaming_when_premium_sent_median": statistics.median(in_flight)
        if in_flight
        else 0,
        "window_s": round(premium_end - started, 2),
        "router_fair_queue_wait": queued,
        # The load generator's own delay in noticing a chunk (its event loop busy with the
        # burst's streams): a TTFT measured here includes it.
        "client_loop_lag_p50_ms": ms(percentile(lags, 50)) if lags else None,
        "client_loop_lag_p99_ms": ms(percentile(lags, 99)) if lags else None,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    log(
        f"{name}: premium TTFT p50 {result['premium_ttft_p50_ms']} ms p99 "
        f"{result['premium_ttft_p99_ms']} ms over {len(ttfts)} (refused {refused}); burst step "
        f"p50 {result['burst_step_gap_p50_ms']} ms, streaming "
        f"{result['burst_streaming_when_premium_sent_median']}; router queue {queued}; client "
        f"loop lag p50/p99 {result['client_loop_lag_p50_ms']}/{result['client_loop_lag_p99_ms']}"
        f" ms; load average {result['load_average_1m']}"
    )
    return result


async def loop_lag(lags: list[float], interval_s: float = 0.01) -> None:
    """How late this process's event loop wakes a sleeper, every interval_s, until cancelled."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(interval_s)
        lags.append(max(0.0, time.perf_counter() - asked - interval_s))


async def run_priority(args: argparse.Namespace, plat: Platform) -> dict[str, Any]:
    plat.start_engine(args)
    redis_url = plat.start_redis()
    tenants = [
        TenantDef("premium", "sk-premium", "critical"),
        TenantDef("batch", "sk-batch", "best-effort"),
    ]
    tenants_file = write_tenants(plat.work / "tenants.yaml", tenants)
    tenancy_args = ["--tenants-file", str(tenants_file), "--quota-store-url", redis_url]
    tenancy = plat.router("router-tenancy", tenancy_args)
    knob_args = [*tenancy_args, "--replica-concurrency", str(args.knob_rc)]
    knob = plat.router("router-tenancy-rc", knob_args)
    # A tenancy router that never declares a better class to the engine: the guard acts only
    # once the engine itself has seen a premium request.
    undeclared = plat.router("router-tenancy-undeclared", [*tenancy_args, "--guard-memory", "0"])
    fcfs = plat.router("router-fcfs", [])
    routers = ((tenancy, "sk-premium"), (knob, "sk-premium"), (undeclared, "sk-premium"))
    for url, key in (*routers, (fcfs, None)):
        await wait_tokenizer(url, key)
    # Warm the engine (first requests compile and fill caches).
    await priority_phase("warm-up", tenancy, False, "sk-premium", None, _short(args))
    phases = {
        "alone": ("alone", tenancy, False, "sk-premium", None),
        "tenancy": ("tenancy", tenancy, True, "sk-premium", "sk-batch"),
        "knob": (f"tenancy rc={args.knob_rc}", knob, True, "sk-premium", "sk-batch"),
        "undeclared": ("tenancy, undeclared", undeclared, True, "sk-premium", "sk-batch"),
        "fcfs": ("fcfs", fcfs, True, None, None),
    }
    results = []
    # The phases run in turn, --rounds times (alone, tenancy, alone, tenancy, ...): what the VM's
    # load does over the run falls on every phase alike, and each phase's p99 is taken over
    # all its rounds' requests together.
    # A phase named twice in --phases runs twice a round; each run of a phase is a round of it.
    runs: dict[str, int] = {}
    for _ in range(args.rounds):
        for key in args.phases.split(","):
            name, url, burst, premium_key, burst_key = phases[key]
            runs[key] = runs.get(key, 0) + 1
            waited = wait_until_idle([plat.engine_pgid()], quiet_cpu_s=0.1, timeout_s=60)
            log(f"phase {name}, round {runs[key]} (engine idle after {waited} s)")
            result = await priority_phase(
                name, url, burst, premium_key, burst_key, args, runs[key] - 1
            )
            results.append({**result, "round": runs[key]})
    pooled = [pool_rounds([r for r in results if r["phase"] == name]) for name in _names(results)]
    alone = (pooled[0]["premium_ttft_p99_ms"] or 0.0) if pooled[0]["phase"] == "alone" else 0.0
    for result in (*pooled, *results):
        result["p99_over_alone"] = (
            round(result["premium_ttft_p99_ms"] / alone, 2) if alone else None
        )
    return {"phases": pooled, "rounds": results, "goal": "tenancy p99 <= 1.2 x alone"}


def _names(results: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["phase"] for r in results))


def pool_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase's rounds as one: its premium TTFTs together, the rest summed or of round 1."""
    ttfts = [t for r in rounds for t in r["premium_ttft_ms"]]
    return {
        **rounds[0],
        "rounds": len(rounds),
        "premium_requests": sum(r["premium_requests"] for r in rounds),
        "premium_refused": [s for r in rounds for s in r["premium_refused"]],
        "premium_ttft_ms": ttfts,
        "premium_ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "premium_ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "premium_ttft_max_ms": max(ttfts, default=0.0),
        "burst_chunks_in_window": sum(r["burst_chunks_in_window"] for r in rounds),
        "window_s": round(sum(r["window_s"] for r in rounds), 2),
        "load_average_1m": [r["load_average_1m"] for r in rounds],
    }


def _short(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "phase_s": 3.0})


def plot_priority(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    phases = data["phases"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [p["phase"] for p in phases]
    x = range(len(names))
    p50 = [p["premium_ttft_p50_ms"] for p in phases]
    p99 = [p["premium_ttft_p99_ms"] for p in phases]
    ax.bar([i - 0.2 for i in x], p50, 0.4, label="premium TTFT p50")
    ax.bar([i + 0.2 for i in x], p99, 0.4, label="premium TTFT p99")
    ax.axhline(1.2 * p99[0], color="k", ls="--", lw=1, label="goal: 1.2 x p99 alone")
    for i, value in enumerate(p99):
        ax.text(i + 0.2, value, f"{value:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_title(f"Premium TTFT under a best-effort burst of {phases[1]['burst_requests']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


# ---- fairness ----


async def fairness_phase(
    url: str, tenants: list[TenantDef], args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    client = StreamClient(url)
    replies: dict[str, list[Reply]] = {t.name: [] for t in tenants}
    stop_at = time.perf_counter() + args.phase_s
    started = time.perf_counter()

    async def worker(tenant: TenantDef) -> None:
        while time.perf_counter() < stop_at:
            reply = Reply()
            replies[tenant.name].append(reply)
            body = chat_body(question(rng), args.max_tokens, ignore_eos=True)
            await stream_chat(client, body, tenant.key, reply)
            if reply.status != 200:
                await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(worker(t)) for t in tenants for _ in range(args.clients)]
    await asyncio.sleep(args.phase_s)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    client.close()
    lo, hi = started + args.warmup_s, started + args.phase_s
    tokens = {
        name: sum(1 for r in rs for t in r.chunk_times if lo <= t < hi)
        for name, rs in replies.items()
    }
    total = sum(tokens.values()) or 1
    weights = {t.name: t.weight for t in tenants}
    shares = {name: tokens[name] / total for name in tokens}
    weight_total = sum(weights.values())
    normalized = [shares[name] / (weights[name] / weight_total) for name in tokens]
    finished = [r for rs in replies.values() for r in rs if r.status == 200 and r.completion_tokens]
    return {
        "weights": weights,
        "tokens_in_window": tokens,
        "tok_per_s": {n: round(v / (hi - lo), 1) for n, v in tokens.items()},
        "shares": {n: round(v, 4) for n, v in shares.items()},
        "weight_shares": {n: round(w / weight_total, 4) for n, w in weights.items()},
        "jain_share_over_weight": round(jain(normalized), 4),
        "window_s": [args.warmup_s, args.phase_s],
        "refused": sum(1 for rs in replies.values() for r in rs if r.status not in (0, 200)),
        "chunks_equal_usage": all(len(r.chunk_times) == r.completion_tokens for r in finished),
    }


async def run_fairness(args: argparse.Namespace, plat: Platform) -> dict[str, Any]:
    plat.start_engine(args)
    redis_url = plat.start_redis()
    results = []
    for weights in ((1, 1, 1), (2, 1, 1)):
        tenants = [
            TenantDef(f"team-{chr(97 + i)}", f"sk-team-{i}", "standard", w)
            for i, w in enumerate(weights)
        ]
        label = "-".join(map(str, weights))
        tenants_file = write_tenants(plat.work / f"tenants-{label}.yaml", tenants)
        router_args = ["--tenants-file", str(tenants_file), "--quota-store-url", redis_url]
        router_args += ["--replica-concurrency", str(args.replica_concurrency)]
        url = plat.router("router-fair", router_args)
        await wait_tokenizer(url, tenants[0].key)
        wait_until_idle([plat.engine_pgid()], quiet_cpu_s=0.1, timeout_s=60)
        log(f"weights {weights}: {args.clients} clients per tenant for {args.phase_s} s")
        result = await fairness_phase(url, tenants, args)
        log(
            f"weights {weights}: shares {result['shares']} tok/s {result['tok_per_s']} "
            f"Jain {result['jain_share_over_weight']}"
        )
        results.append(result)
        plat.stop_router(url)
    return {"phases": results, "goal": "Jain(share/weight) >= 0.95"}


def plot_fairness(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(data["phases"]), figsize=(9, 4), sharey=True)
    for ax, phase in zip(axes, data["phases"], strict=True):
        names = list(phase["shares"])
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [phase["shares"][n] for n in names], 0.4, label="share")
        ax.bar(
            [i + 0.2 for i in x], [phase["weight_shares"][n] for n in names], 0.4,
            label="weight / sum", alpha=0.6,
        )  # fmt: skip
        ax.set_xticks(list(x), names)
        weights = ":".join(str(phase["weights"][n]) for n in names)
        ax.set_title(f"weights {weights}: Jain {phase['jain_share_over_weight']:.3f}")
    axes[0].set_ylabel("share of tokens in the steady window")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


# ---- quota ----


async def run_quota(args: argparse.Namespace, plat: Platform) -> dict[str, Any]:
    plat.start_engine(args)
    redis_url = plat.start_redis()
    tenant = TenantDef("metered", "sk-metered", quota={"tokensPerMinute": args.tokens_per_minute})
    tenants_file = write_tenants(plat.work / "tenants.yaml", [tenant])
    router_args = ["--tenants-file", str(tenants_file), "--quota-store-url", redis_url]
    routers = [plat.router(f"router-{i}", router_args) for i in range(2)]
    for url in routers:
        await wait_tokenizer(url, tenant.key)
    # Warm the engine outside the measured window: through neither router (no quota spent).
    async with httpx.AsyncClient(timeout=120) as http:
        body = chat_body("Hello?", 8)
        await http.post(f"{plat.engine_url}/v1/chat/completions", json=body)
        window_start = (time.time() // 60 + 1) * 60
        log(f"waiting {window_start - time.time():.1f} s for the next quota window")
        await asyncio.sleep(window_start - time.time() + 0.2)
        stop_at = window_start + 60 - args.stop_before_s
        rng = random.Random(args.seed)
        records: list[dict[str, Any]] = []
        counter = iter(range(1 << 30))
        headers = {"Authorization": f"Bearer {tenant.key}"}

        async def worker() -> None:
            while time.time() < stop_at:
                n = next(counter)
                router = n % 2
                sent = time.time()
                response = await http.post(
                    f"{routers[router]}/v1/chat/completions",
                    json=chat_body(question(rng), args.max_tokens),
                    headers=headers,
                )
                record = {
                    "n": n, "router": router, "sent_s": round(sent - window_start, 3),
                    "end_s": round(time.time() - window_start, 3), "status": response.status_code,
                    "remaining_tokens": response.headers.get("x-ratelimit-remaining-tokens"),
                }  # fmt: skip
                if response.status_code == 200:
                    usage = response.json()["usage"]
                    record["tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                else:
                    record["retry_after"] = response.headers.get("retry-after")
                    record["code"] = (response.json().get("error") or {}).get("code")
                records.append(record)
                if response.status_code != 200:
                    await asyncio.sleep(args.refused_pause_s)

        await asyncio.gather(*(worker() for _ in range(args.clients)))
    served = [r for r in records if r["status"] == 200]
    refused = [r for r in records if r["status"] == 429]
    in_window = [r for r in served if r["end_s"] < 60]
    tokens = sum(r["tokens"] for r in in_window)
    result = {
        "tokens_per_minute": args.tokens_per_minute,
        "clients": args.clients,
        "requests": len(records),
        "served": len(served),
        "served_per_router": [sum(1 for r in served if r["router"] == i) for i in range(2)],
        "tokens_served_in_window": tokens,
        "over_quota": round(tokens / args.tokens_per_minute - 1, 4),
        "refused_429": len(refused),
        "refused_per_router": [sum(1 for r in refused if r["router"] == i) for i in range(2)],
        "refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
        "refused_codes": sorted({str(r.get("code")) for r in refused}),
        "first_refusal_s": min((r["sent_s"] for r in refused), default=None),
        "other_status": sorted({r["status"] for r in records} - {200, 429}),
        "records": records,
        "goal": "tokens served in the window <= 1.10 x tokensPerMinute",
    }
    log(
        f"served {tokens} tokens in the window against {args.tokens_per_minute} "
        f"({100 * result['over_quota']:+.1f} %); {len(refused)} refused 429 "
        f"({result['refused_with_retry_after']} with Retry-After)"
    )
    return result


def plot_quota(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    served = sorted((r for r in data["records"] if r["status"] == 200), key=lambda r: r["end_s"])
    for router in (0, 1):
        mine = [r for r in served if r["router"] == router]
        ax.step(
            [r["end_s"] for r in mine],
            [sum(m["tokens"] for m in mine[: i + 1]) for i in range(len(mine))],
            where="post", label=f"router {router}",
        )  # fmt: skip
    ax.step(
        [r["end_s"] for r in served],
        [sum(m["tokens"] for m in served[: i + 1]) for i in range(len(served))],
        where="post", label="both", color="k",
    )  # fmt: skip
    ax.axhline(data["tokens_per_minute"], color="r", ls="--", lw=1, label="tokensPerMinute")
    refused = [r["sent_s"] for r in data["records"] if r["status"] == 429]
    ax.plot(refused, [0] * len(refused), "|", color="r", ms=12, label="429")
    ax.set_xlabel("s into the quota window")
    ax.set_ylabel("tokens served (prompt + completion)")
    over = 100 * data["over_quota"]
    ax.set_title(f"One tenant, two routers, one Redis: {over:+.1f} % of the quota")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


# ---- overhead ----

STAND_IN_PROMPT = list(range(200, 264))  # token ids: the router needs no tokenizer


def stand_in_main(args: argparse.Namespace) -> None:
    """A replica that answers every completion at once, and its kv-events stream (idle)."""
    import msgspec
    from aiohttp import web

    from kvpilot.contract.block_hash import HASH_SCHEME
    from kvpilot.contract.kv_events import KV_EVENTS_PATH, KvHeartbeat, KvSnapshot, Load

    load = Load(max_num_seqs=256)
    answer = {
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": len(STAND_IN_PROMPT), "completion_tokens": 1,
                  "total_tokens": len(STAND_IN_PROMPT) + 1},
    }  # fmt: skip

    async def kv_events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await response.prepare(request)
        await response.write(
            msgspec.json.encode(KvSnapshot(0, MODEL, 16, HASH_SCHEME, [], load)) + b"\n"
        )
        while True:
            await asyncio.sleep(0.5)
            try:
                await response.write(msgspec.json.encode(KvHeartbeat(0, load)) + b"\n")
            except ConnectionResetError:  # the router went away
                return response

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(answer)

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    app = web.Application()
    app.router.add_get(KV_EVENTS_PATH, kv_events)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/ready", ready)
    app.router.add_get("/health", ready)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        # processes.ServerProcess finds the port by uvicorn's line.
        print(f"Uvicorn running on http://127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system): what the machine's load does not inflate
    (a process waiting for a core is not charged)."""
    # /proc/PID/stat: the fields after the command's closing parenthesis; utime and stime are
    # the 12th and 13th of them, in clock ticks.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_overhead(args: argparse.Namespace, plat: Platform) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "stand-in"]
    stand_in = ServerProcess("stand-in", cmd, "/ready", log=plat.work / "stand-in.log")
    plat.processes.append(stand_in)
    engine = stand_in.wait_ready(60)
    redis_url = plat.start_redis()
    assert plat.redis is not None
    tenant = TenantDef(
        "metered", "sk-metered",
        quota={"tokensPerMinute": 10**9, "requestsPerMinute": 10**7, "maxConcurrent": 64},
    )  # fmt: skip
    unmetered = TenantDef("unmetered", "sk-unmetered")
    tenants_file = write_tenants(plat.work / "tenants.yaml", [tenant, unmetered])
    tenancy_args = ["--tenants-file", str(tenants_file), "--quota-store-url", redis_url]
    tenancy = plat.router("router-tenancy", tenancy_args, engine)
    plain = plat.router("router-plain", [], engine)
    variants = {
        "direct": (engine, None),
        "router": (plain, None),
        "router+tenancy": (tenancy, tenant.key),
        # The same router, a tenant without a quota: what the quota's store costs.
        "router+tenancy, no quota": (tenancy, unmetered.key),
    }
    if args.before:
        # The same tenancy router from another checkout (its kvpilot package first on the path):
        # a change's before and after, side by side in one run.
        env = {**os.environ, "PYTHONPATH": str(args.before)}
        before = plat.router("router-tenancy-before", tenancy_args, engine, env)
        variants["router+tenancy (before)"] = (before, tenant.key)
    router_pids = {
        name: plat.process_at(url).proc.pid for name, (url, _) in variants.items() if url != engine
    }
    # Token ids as the prompt: the routers need no tokenizer (the stand-in serves none).
    body = {"model": MODEL, "prompt": STAND_IN_PROMPT, "max_tokens": 1}
    names = list(variants)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}  # per repeat
    cpu_ms: dict[str, list[float]] = {name: [] for name in router_pids}  # per repeat
    redis_cpu_ms: dict[str, list[float]] = {name: [] for name in router_pids}
    load: list[list[float]] = []
    async with httpx.AsyncClient(timeout=30) as http:

        async def one(name: str) -> float:
            url, key = variants[name]
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            started = time.perf_counter()
            response = await http.post(f"{url}/v1/completions", json=body, headers=headers)
            elapsed = time.perf_counter() - started
            if response.status_code != 200:
                raise RuntimeError(f"{name}: {response.status_code} {response.text[:200]}")
            return elapsed

        for name in variants:  # connections and first-request paths warm
            for _ in range(20):
                await one(name)
        for repeat in range(args.repeats):
            load.append(list(os.getloadavg()))
            # Latency: the four alternate request by request, each first as often.
            for name in names:
                samples[name].append([])
            for i in range(args.samples):
                order = names[i % len(names) :] + names[: i % len(names)]
                for name in order:
                    samples[name][-1].append(await one(name))
            # CPU: a block of requests per router variant, its router's (and redis-server's)
            # CPU time over the block.
            for name, pid in router_pids.items():
                before, redis_before = cpu_seconds(pid), cpu_seconds(plat.redis.proc.pid)
                for _ in range(args.cpu_requests):
                    await one(name)
                used = cpu_seconds(pid) - before
                redis_used = cpu_seconds(plat.redis.proc.pid) - redis_before
                cpu_ms[name].append(round(1000 * used / args.cpu_requests, 4))
                redis_cpu_ms[name].append(round(1000 * redis_used / args.cpu_requests, 4))
            p50 = {name: 1000 * statistics.median(samples[name][-1]) for name in names}
            log(
                f"repeat {repeat + 1}/{args.repeats}: p50 ms "
                + ", ".join(f"{n} {v:.3f}" for n, v in p50.items())
                + "; router CPU ms/request "
                + ", ".join(f"{n} {v[-1]:.3f}" for n, v in cpu_ms.items())
            )
        load.append(list(os.getloadavg()))
    flat = {name: [x for run in runs for x in run] for name, runs in samples.items()}
    p50 = {name: statistics.median(v) for name, v in flat.items()}
    per_repeat = {
        name: [round(1000 * statistics.median(run), 3) for run in runs]
        for name, runs in samples.items()
    }

    def added(runs_a: list[float], runs_b: list[float]) -> list[float]:
        return [round(a - b, 3) for a, b in zip(runs_a, runs_b, strict=True)]

    cpu_median = {name: statistics.median(v) for name, v in cpu_ms.items()}
    result = {
        "samples_per_variant": args.samples * args.repeats,
        "repeats": args.repeats,
        "p50_ms": {n: round(1000 * v, 3) for n, v in p50.items()},
        "p99_ms": {n: round(percentile(v, 99) * 1000, 3) for n, v in flat.items()},
        "p50_ms_per_repeat": per_repeat,
        "router_added_p50_ms": round(1000 * (p50["router"] - p50["direct"]), 3),
        "tenancy_added_p50_ms": round(1000 * (p50["router+tenancy"] - p50["router"]), 3),
        "tenancy_added_p50_ms_per_repeat": added(
            per_repeat["router+tenancy"], per_repeat["router"]
        ),
        "tenancy_without_quota_added_p50_ms": round(
            1000 * (p50["router+tenancy, no quota"] - p50["router"]), 3
        ),
        **(
            {
                "tenancy_before_added_p50_ms": round(
                    1000 * (p50["router+tenancy (before)"] - p50["router"]), 3
                ),
                "tenancy_before_added_p50_ms_per_repeat": added(
                    per_repeat["router+tenancy (before)"], per_repeat["router"]
                ),
                "tenancy_before_added_cpu_ms_per_request": round(
                    cpu_median["router+tenancy (before)"] - cpu_median["router"], 4
                ),
            }
            if args.before
            else {}
        ),
        "cpu_requests_per_block": args.cpu_requests,
        "router_cpu_ms_per_request": cpu_ms,
        "redis_cpu_ms_per_request": redis_cpu_ms,
        "tenancy_added_cpu_ms_per_request": round(
            cpu_median["router+tenancy"] - cpu_median["router"], 4
        ),
        "tenancy_without_quota_added_cpu_ms_per_request": round(
            cpu_median["router+tenancy, no quota"] - cpu_median["router"], 4
        ),
        "load_average_1_5_15": load,
        "samples_ms": {n: [round(1000 * s, 3) for s in v] for n, v in flat.items()},
        "goal": "tenancy adds <= 1 ms p50",
    }
    log(
        f"p50 ms {result['p50_ms']}; tenancy adds {result['tenancy_added_p50_ms']} ms p50, "
        f"{result['tenancy_added_cpu_ms_per_request']} ms of router CPU per request"
    )
    return result


def plot_overhead(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4))
    names = list(data["samples_ms"])
    ax.boxplot([data["samples_ms"][n] for n in names], showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names)
    for i, name in enumerate(names, 1):
        ax.text(i, data["p50_ms"][name], f" p50 {data['p50_ms'][name]:.2f}", fontsize=8)
    ax.set_ylabel("end-to-end latency, ms (whiskers: 1.5 IQR)")
    ax.set_title(f"Tenancy adds {data['tenancy_added_p50_ms']:.2f} ms p50 (stand-in engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


# ---- main ----

CASES = {
    "priority": (run_priority, plot_priority),
    "fairness": (run_fairness, plot_fairness),
    "quota": (run_quota, plot_quota),
    "overhead": (run_overhead, plot_overhead),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=BENCH, help="where JSON and PNG go")
    parser.add_argument("--work", type=Path, default=BENCH / "out" / "tenancy", help="logs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the engine's")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the engine's (default: its own)"
    )
    parser.add_argument(
        "--engine-cpu",
        type=int,
        default=None,
        help="bind the engine core to this CPU (--engine-cpus) and run the routers, "
        "redis-server and the load generator on the others (default: unbound)",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="one more `kvpilot serve` flag, e.g. --engine-arg=--priority-guard-tokens=4",
    )
    cases = parser.add_subparsers(dest="case", required=True)
    p = cases.add_parser("priority", help="premium TTFT under a best-effort burst")
    p.add_argument("--burst", type=int, default=150)
    p.add_argument("--burst-max-tokens", type=int, default=64)
    p.add_argument("--burst-lead-s", type=float, default=1.0)
    p.add_argument("--premium-interval", type=float, default=0.5)
    p.add_argument(
        "--premium-lead-s",
        type=float,
        default=3.0,
        help="premium traffic before the burst, not counted (0: premium starts after the burst)",
    )
    p.add_argument("--phase-s", type=float, default=25.0)
    p.add_argument("--rounds", type=int, default=1, help="the phases in turn, this many times")
    p.add_argument("--knob-rc", type=int, default=4, help="the knob phase's --replica-concurrency")
    p.add_argument(
        "--phases", default="alone,tenancy,knob,fcfs", help="which, in this order (alone first)"
    )
    f = cases.add_parser("fairness", help="token shares at weights 1:1:1 and 2:1:1")
    f.add_argument("--clients", type=int, default=6, help="concurrent streams per tenant")
    f.add_argument("--max-tokens", type=int, default=32)
    f.add_argument("--replica-concurrency", type=int, default=4)
    f.add_argument("--phase-s", type=float, default=45.0)
    f.add_argument("--warmup-s", type=float, default=10.0)
    q = cases.add_parser("quota", help="one tenant's tokensPerMinute across two routers")
    q.add_argument("--tokens-per-minute", type=int, default=3000)
    q.add_argument("--clients", type=int, default=4)
    q.add_argument("--max-tokens", type=int, default=32)
    q.add_argument("--stop-before-s", type=float, default=5.0)
    q.add_argument("--refused-pause-s", type=float, default=1.0)
    o = cases.add_parser("overhead", help="latency tenancy adds (stand-in engine)")
    o.add_argument("--samples", type=int, default=500, help="requests per variant per repeat")
    o.add_argument("--repeats", type=int, default=3)
    o.add_argument(
        "--cpu-requests", type=int, default=300, help="requests per router CPU block per repeat"
    )
    o.add_argument(
        "--before",
        type=Path,
        default=None,
        help="a folder holding another checkout's code as a `kvpilot` package: its tenancy "
        "router runs as a fifth variant (e.g. the code before a change)",
    )
    cases.add_parser("stand-in", help="(internal) the overhead case's stand-in engine")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.case == "stand-in":
        stand_in_main(args)
        return
    run, plot = CASES[args.case]
    work = args.work / args.case
    work.mkdir(parents=True, exist_ok=True)
    plat = Platform(work)
    # A SIGTERM ends the run as Ctrl-C does: the engine, routers and redis-server are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.perf_counter()
    try:
        data = asyncio.run(run(args, plat))
    finally:
        plat.stop()
    data = {
        "case": args.case,
        "command": "python bench/tenancy.py " + " ".join(sys.argv[1:]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(time.perf_counter() - started, 1),
        **data,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / f"tenancy_{args.case}.json", data)
    plot(data, args.out_dir / f"tenancy_{args.case}.png")


if __name__ == "__main__":
    main()
