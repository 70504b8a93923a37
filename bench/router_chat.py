"""Multi-tenant chat through `kvpilot router` vs plain round-robin, on 3 loopback replicas.

Workload (seeded): T tenants, each with its own long system prompt (sentences drawn from a word
list, about `--system-words` words); C conversations spread over the tenants, each of `--turns`
turns: a short user message, the model's reply (greedy, at most `--max-tokens` tokens) appended
to the history, then the next turn. `--concurrency` conversations run at once; each request
streams (TTFT = first content chunk) with usage, whose `cached_tokens` gives the prefix-cache hit.

Passes, in one run, on the same 3 `kvpilot serve` replicas (`--blocks` KV blocks of 16 each):
1. round-robin, i.e. a Kubernetes Service in front of the replicas, with one of two spreads
   (`--spread`): `random` (the default), each request to a replica drawn from a seeded hash of
   its conversation and turn, as kube-proxy's default (iptables) mode draws an endpoint per
   connection and a chat frontend's pooled connections carry any conversation's turns; or
   `cycle`, the client cycling one counter over the replicas. `cycle` is not a fair baseline in
   this closed loop: with 6 workers each sending its conversation's next turn when the last
   ends, the counter's phase lines a worker up with the same replica more often than chance
   (37-47 % of next turns on the same replica against 33 %, varying with the machine's timing),
   which made round-robin's hit rate 34-45 % on the same seed;
2. router: every request through `kvpilot router --static` in front of the same replicas;
3. one replica holding everything: the same workload on one replica with 3x the blocks (the
   3 replicas are stopped first), the hit rate a perfect router could reach at best.
Each pass salts its requests (`cache_salt` per tenant and pass), so no pass reuses another's blocks.
Each request is recorded with its conversation, tenant, send time and the router's route header;
`loss_vs_single` in the output sums, per cause, the cached tokens round-robin and the router
lost against the one-replica pass (conversation moved, history evicted, cold first turn).

Then the router's overhead: one cached-prefix request, sent alternately straight to the replica
holding it and through the router (`--overhead-samples` each), end-to-end latency p50 of each;
the router process's CPU time (user + system, from /proc) over those requests, per routed
request (it includes the block events the direct requests cause: small); and the router's own
CPU work for that request in this process (parse, chat template, tokenize, hash, choose), timed
over 200 repetitions (the same request each time: the tokenizer's piece cache holds its system
prompt after the first, as it would a conversation's earlier turns). `--profile FILE` also writes
the router's CPU by function over the overhead requests (cProfile, process clock; it slows the
router, so the overhead figures of that run are not comparable): `python
bench/common/router_profile.py --print FILE`.

    python bench/router_chat.py --out bench/router_chat.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

_WORD_LIST = (
    "account bicycle billing booking cancel customer delivery deposit discount email engine "
    "evening express failure feature garden helmet holiday invoice kitchen ladder license "
    "limit manager market member monthly morning network notice office order parking payment "
    "policy premium printer product refund region rental repair return route schedule season "
    "service shipping station storage support ticket travel upgrade voucher warranty weekend"
)
WORDS = _WORD_LIST.split()
MODEL = "bench"
UVICORN_PORT = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@dataclass
class Result:
    turn: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    # Which conversation and tenant (for a loss breakdown) and the router's x-kvpilot-route.
    conversation: int = -1
    tenant: int = -1
    route: str = ""
    sent_s: float = 0.0  # when the request left, from the pass's start


@dataclass
class PassReport:
    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        prompt = sum(r.prompt_tokens for r in self.results)
        cached = sum(r.cached_tokens for r in self.results)
        ttfts = sorted(r.ttft_s for r in self.results)
        per_replica: dict[str, int] = {}
        for r in self.results:
            per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
        mean = len(self.results) / max(1, len(per_replica))
        return {
            "requests": len(self.results),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99),
            "requests_per_replica": per_replica,
            "max_over_mean_requests": max(per_replica.values()) / mean if per_replica else 0.0,
            "wall_s": self.wall_s,
        }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def system_prompt(rng: random.Random, tenant: int, num_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(num_words)]
    sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
    return f"You are the assistant of tenant {tenant}. " + " ".join(sentences)


def user_message(rng: random.Random) -> str:
    return "Question: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 24))) + "?"


# ---- processes ----


class Proc:
    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.port: int | None = None
        self.proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stderr:
                log.write(line)
                log.flush()
                found = UVICORN_PORT.search(line)
                if found:
                    self.port = int(found.group(1))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited; see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {timeout} s; see {self.log_path}")
            if self.port is not None:
                try:
                    if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def serve(blocks: int, log_path: Path, env: dict[str, str] | None = None) -> Proc:
    cmd = [sys.executable, "-m", "kvpilot.cli", "serve", "--port", "0", "--served-model-name"]
    cmd += [MODEL, "--num-gpu-blocks-override", str(blocks), "--block-size", "16"]
    cmd += ["--max-model-len", "2048", "--max-num-seqs", "16"]
    return Proc(cmd, log_path, env)


# ---- the workload ----


@dataclass(frozen=True)
class Conversation:
    tenant: int
    system: str
    questions: tuple[str, ...]
    number: int = -1


def workload(args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)
    systems = [system_prompt(rng, t, args.system_words) for t in range(args.tenants)]
    conversations = []
    for c in range(args.conversations):
        tenant = c % args.tenants
        questions = tuple(user_message(rng) for _ in range(args.turns))
        conversations.append(Conversation(tenant, systems[tenant], questions, c))
    rng.shuffle(conversations)
    return conversations


async def one_turn(
    http: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, str]],
    salt: str,
    args: argparse.Namespace,
) -> tuple[Result, str]:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }
    started = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        replica = response.headers.get("x-kvpilot-replica", url)
        route = response.headers.get("x-kvpilot-route", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text.append(content)
    latency = time.perf_counter() - started
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    result = Result(0, replica, usage.get("prompt_tokens", 0), cached, ttft or latency, latency)
    result.route, result.sent_s = route, started
    return result, "".join(text)


def spread(
    urls: list[str], counter: int, conversation: int, turn: int, args: argparse.Namespace
) -> str:
    """Where a request goes: the one URL (the router), or one of the replicas."""
    if len(urls) == 1 or args.spread == "cycle":
        return urls[counter % len(urls)]
    return urls[random.Random(f"{args.seed}/{conversation}/{turn}").randrange(len(urls))]


async def run_pass(
    name: str, urls: list[str], conversations: list[Conversation], args: argparse.Namespace
) -> PassReport:
    report = PassReport(name)
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for conversation in conversations:
        queue.put_nowait(conversation)
    counter = iter(range(1 << 30))
    pass_started = time.perf_counter()

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            conversation = queue.get_nowait()
            messages = [{"role": "system", "content": conversation.system}]
            for turn, question in enumerate(conversation.questions):
                messages.append({"role": "user", "content": question})
                url = spread(urls, next(counter), conversation.number, turn, args)
                result, answer = await one_turn(
                    http, url, messages, f"{name}-{conversation.tenant}", args
                )
                result.turn = turn
                result.conversation, result.tenant = conversation.number, conversation.tenant
                result.sent_s -= pass_started
                report.results.append(result)
                messages.append({"role": "assistant", "content": answer})

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    report.wall_s = time.perf_counter() - started
    return report


def process_cpu_s(pid: int) -> float | None:
    """A process's user + system CPU seconds (Linux /proc); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def overhead(router_url: str, router_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """Latency of one cached-prefix request straight to its holder vs through the router, and
    the router process's CPU per routed request."""
    rng = random.Random(args.seed + 1)
    messages = [
        {"role": "system", "content": system_prompt(rng, 99, args.system_words)},
        {"role": "user", "content": "Hello?"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "cache_salt": "overhead"}
    async with httpx.AsyncClient(timeout=60) as http:
        first = await http.post(f"{router_url}/v1/chat/completions", json=body)
        holder = first.headers["x-kvpilot-replica"]
        index = (await http.get(f"{router_url}/kvpilot/v1/router/index")).json()[MODEL]
        holder_url = index[holder]["url"]
        direct, routed = [], []
        if args.profile is not None:
            args.profile.unlink(missing_ok=True)
            os.kill(router_pid, signal.SIGUSR1)
        cpu_before = process_cpu_s(router_pid)
        for i in range(2 * args.overhead_samples):
            url = holder_url if i % 2 == 0 else router_url
            started = time.perf_counter()
            response = await http.post(f"{url}/v1/chat/completions", json=body)
            elapsed = time.perf_counter() - started
            assert response.status_code == 200, response.text
            if url == router_url:
                assert response.headers["x-kvpilot-replica"] == holder
                assert response.headers["x-kvpilot-route"].startswith("prefix")
            (direct if url == holder_url else routed).append(elapsed)
        cpu_after = process_cpu_s(router_pid)
        if args.profile is not None:
            os.kill(router_pid, signal.SIGUSR2)
    cpu_ms = (
        None
        if cpu_before is None or cpu_after is None
        else 1000 * (cpu_after - cpu_before) / args.overhead_samples
    )
    return {
        "direct_p50_ms": 1000 * statistics.median(direct),
        "router_p50_ms": 1000 * statistics.median(routed),
        "added_p50_ms": 1000 * (statistics.median(routed) - statistics.median(direct)),
        "router_process_cpu_ms_per_request": cpu_ms,
        "router_cpu_ms": await asyncio.to_thread(router_cpu_ms, holder_url, body),
    }


def router_cpu_ms(replica_url: str, body: dict[str, Any]) -> float:
    """The router's own work for one request, in this process: parse, template, tokenize,
    hash the blocks, score 3 candidates."""
    from kvpilot.router.config import RoutingConfig
    from kvpilot.router.index import BlockIndex
    from kvpilot.router.prompts import block_chain, parse, prompt_token_ids
    from kvpilot.router.scoring import Candidate, choose
    from kvpilot.router.tokenizer import fetch_tokenizer

    async def load() -> Any:
        async with httpx.AsyncClient() as http:
            return await fetch_tokenizer(http, replica_url)

    tokenizer = asyncio.run(load())
    raw = json.dumps(body).encode()
    index = BlockIndex(1 << 20)
    chain = block_chain(prompt_token_ids(parse("chat", raw), tokenizer), 16, "overhead")
    index.reset(chain)
    config = RoutingConfig()
    timings = []
    for _ in range(200):
        started = time.perf_counter()
        parsed = parse("chat", raw)
        chain = block_chain(prompt_token_ids(parsed, tokenizer), 16, parsed.request.cache_salt)
        candidates = [Candidate(n, index.matched_blocks(chain), 0, 0, 0.1) for n in "abc"]
        choose(
            candidates, num_blocks=len(chain), tie_key=str(chain[0]), session_id=None, config=config
        )
        timings.append(time.perf_counter() - started)
    return 1000 * statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every reply exactly --max-tokens long (chat replies of a realistic length)",
    )
    parser.add_argument(
        "--spread",
        choices=("random", "cycle"),
        default="random",
        help="how the round-robin pass spreads requests over the replicas (see above)",
    )
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--blocks", type=int, default=96, help="KV blocks per replica")
    parser.add_argument("--overhead-samples", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-single", action="store_true")
    parser.add_argument(
        "--overhead-only", action="store_true", help="only the router's added latency"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="profile the router's CPU (cProfile, process clock) over the overhead requests "
        "into this pstats file (bench/common/router_profile.py); it inflates router_process_cpu",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/router_chat.json"))
    args = parser.parse_args()
    logs = args.out.with_suffix("").with_name(args.out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    conversations = workload(args)
    report: dict[str, Any] = {
        "config": vars(args) | {"out": str(args.out), "profile": args.profile and str(args.profile)}
    }

    replicas = [serve(args.blocks, logs / f"replica-{i}.log") for i in range(3)]
    router = None
    try:
        for replica in replicas:
            replica.wait_ready()
        static = "bench=" + ",".join(r.url for r in replicas)
        launch = [sys.executable, "-m", "kvpilot.cli"]
        if args.profile is not None:  # profiled between two signals, around the overhead requests
            launch = [sys.executable, str(Path(__file__).parent / "common" / "router_profile.py")]
            launch += [str(args.profile), "--"]
        router = Proc(
            [*launch, "router", "--static", static, "--host", "127.0.0.1", "--port", "0"],
            logs / "router.log",
        )
        router.wait_ready()
        urls = [r.url for r in replicas]
        # Warm-up, unmeasured: every replica and the router see a request first.
        asyncio.run(run_pass("warmup", urls, conversations[:3], args))
        passes = {}
        if args.overhead_only:
            report["overhead"] = asyncio.run(overhead(router.url, router.proc.pid, args))
            print("overhead", report["overhead"], flush=True)
            args.out.write_text(json.dumps(report, indent=1))
            return
        passes["round_robin"] = asyncio.run(run_pass("round_robin", urls, conversations, args))
        print("round-robin", passes["round_robin"].summary(), flush=True)
        passes["router"] = asyncio.run(run_pass("router", [router.url], conversations, args))
        print("router", passes["router"].summary(), flush=True)
        report["overhead"] = asyncio.run(overhead(router.url, router.proc.pid, args))
        print("overhead", report["overhead"], flush=True)
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()
    if not args.skip_single:
        single = serve(3 * args.blocks, logs / "single.log")
        try:
            single.wait_ready()
            asyncio.run(run_pass("warmup", [single.url], conversations[:3], args))
            passes["single"] = asyncio.run(run_pass("single", [single.url], conversations, args))
            print("single", passes["single"].summary(), flush=True)
        finally:
            single.stop()
    report["summary"] = {name: p.summary() for name, p in passes.items()}
    report["requests"] = {name: [asdict(r) for r in p.results] for name, p in passes.items()}
    if "single" in passes:
        report["loss_vs_single"] = {
            name: loss_breakdown(report["requests"], name) for name in ("round_robin", "router")
        }
        print("tokens lost against one replica, by cause", report["loss_vs_single"], flush=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(report["summary"], args.out.with_suffix(".png"))


def loss_breakdown(requests: dict[str, list[dict[str, Any]]], name: str) -> dict[str, list[int]]:
    """Where a pass loses cached tokens against the one-replica pass, request by request (the
    same conversation and turn): cause -> [tokens lost, requests]. A turn is `moved` when it
    went to another replica than its conversation's previous turn (with the router's route
    reason), `history evicted` when it stayed but found less than the previous turn's prompt; a
    first turn is cold when it found nothing though its tenant's prompt had been sent before,
    to another replica or to this one (then evicted, or still being computed)."""
    single = {(r["conversation"], r["turn"]): r for r in requests["single"]}
    previous: dict[int, dict[str, Any]] = {}
    tenant_replicas: dict[int, set[str]] = {}
    causes: dict[str, list[int]] = {}
    for r in sorted(requests[name], key=lambda r: r["sent_s"]):
        reason = f" ({r['route'].split(';')[0]})" if r["route"] else ""
        seen = tenant_replicas.setdefault(r["tenant"], set())
        if r["turn"] > 0:
            before = previous[r["conversation"]]
            if r["replica"] != before["replica"]:
                cause = "turn moved off its conversation's replica" + reason
            elif r["cached_tokens"] < before["prompt_tokens"] // 16 * 16 - 16:
                cause = "turn on its replica, history evicted"
            else:
                cause = "turn on its replica, history held"
        elif r["cached_tokens"] > 0:
            cause = "first turn, tenant prompt found"
        elif not seen:
            cause = "first turn, tenant never sent before"
        elif r["replica"] in seen:
            cause = "first turn cold where the tenant was sent before (evicted or in flight)"
        else:
            cause = "first turn cold, tenant prompt on another replica" + reason
        lost = single[(r["conversation"], r["turn"])]["cached_tokens"] - r["cached_tokens"]
        entry = causes.setdefault(cause, [0, 0])
        entry[0] += lost
        entry[1] += 1
        previous[r["conversation"]] = r
        seen.add(r["replica"])
    return dict(sorted(causes.items(), key=lambda kv: -kv[1][0]))


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [100 * summary[n]["hit_rate"] for n in names], color="tab:blue")
    axes[0].set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    width = 0.38
    xs = range(len(names))
    axes[1].bar(
        [x - width / 2 for x in xs], [summary[n]["ttft_p50_ms"] for n in names], width, label="p50"
    )
    axes[1].bar(
        [x + width / 2 for x in xs], [summary[n]["ttft_p99_ms"] for n in names], width, label="p99"
    )
    axes[1].set_xticks(list(xs), names)
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].legend()
    fig.suptitle("multi-tenant chat on 3 loopback replicas: router vs round-robin")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
