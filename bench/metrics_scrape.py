"""What one /metrics scrape costs: the server's metrics written by prometheus_client's
generate_latest (the registry, every metric) against ServerMetrics.exposition() (the fast path
/metrics takes), alternating, on one ServerMetrics filled as a busy server's would be.

    python bench/metrics_scrape.py --rounds 5 --scrapes 200
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.metrics import EngineCounters, ServerMetrics


def busy_metrics(seed: int = 0) -> tuple[ServerMetrics, CollectorRegistry]:
    """SmolLM2's server metrics after 500 finished requests of ~64 tokens."""
    registry = CollectorRegistry()
    metrics = ServerMetrics(
        registry,
        "SmolLM2-135M-Instruct",
        block_size=32,
        num_gpu_blocks=1456,
        enable_prefix_caching=True,
        max_model_len=8192,
    )
    metrics.bind_engine_state(lambda: 3, lambda: 17, lambda: 0.4)
    rng = random.Random(seed)
    for i in range(500):
        metrics.record_counters(EngineCounters(i * 130, i * 20, 0, i * 130, i * 64))
        for _ in range(63):
            metrics.inter_token_latency.observe(rng.uniform(0.02, 0.2))
        start = rng.uniform(0, 100)
        output = RequestOutput(
            str(i), None, [1] * rng.randint(64, 192),
            [CompletionOutput(0, "x", [5] * 64, finish_reason="length")], True,
            metrics=RequestMetrics(start, start + 0.2, start + 0.5, start + 6.0, start + 6.0),
        )  # fmt: skip
        metrics.record_finished(output, "length", SamplingParams(max_tokens=64))
    return metrics, registry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scrapes", type=int, default=200, help="scrapes per round and way")
    args = ap.parse_args()
    metrics, registry = busy_metrics()
    ways = {
        "generate_latest(registry)": lambda: generate_latest(registry),
        "ServerMetrics.exposition()": metrics.exposition,
    }
    body = metrics.exposition()
    lines = body.count(b"\n")
    print(f"{lines} lines, {len(body)} bytes per scrape")
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, scrape in ways.items():
            start = time.perf_counter()
            for _ in range(args.scrapes):
                scrape()
            times[name].append((time.perf_counter() - start) / args.scrapes * 1e3)
    for name, ms in times.items():
        print(f"{name:28s} {statistics.median(ms):6.2f} ms per scrape (rounds: "
              + ", ".join(f"{t:.2f}" for t in ms) + ")")  # fmt: skip
    ratio = statistics.median(times["generate_latest(registry)"]) / statistics.median(
        times["ServerMetrics.exposition()"]
    )
    print(f"exposition() is {ratio:.1f}x faster")


if __name__ == "__main__":
    main()
