"""Freed heap memory kept (the engine's default on CPU) against glibc's own thresholds, A/B.

The engine calls engine/cpu/heap.retain_freed_memory at start-up; `retain_freed_memory=False`
leaves glibc as it is. The setting is process-wide and cannot be undone, so each variant runs in a
fresh process of its own, the two alternating (A B, B A, ...): every process builds an offline
`LLM`, runs the workload `--runs` times (the first run unmeasured: warm-up) and reports each run's
throughput and the minor page faults it took, and at the end its peak resident memory (what
keeping the memory costs).

Workload: 64 prompts of 64-192 random token ids (a new draw each run), max batch 64, 2048-token
steps; `--max-tokens 1` measures prefill alone (the steps that set TTFT when many requests arrive
at once), a larger value prefill and decode.

    python bench/heap_retain_ab.py --dtype bfloat16 --pairs 3 --runs 6 --max-tokens 1
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

VARIANTS = {"retain": True, "glibc": False}


def worker(dtype: str, retain: bool, runs: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(
        dtype=dtype,
        block_size=32,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        retain_freed_memory=retain,
    )
    rng = random.Random(seed)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * 64
    results = []
    for _ in range(runs):
        prompts = [
            [rng.randrange(1000, 40000) for _ in range(rng.randint(64, 192))] for _ in range(64)
        ]
        assert llm.reset_prefix_cache()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        tokens = sum(map(len, prompts)) + 64 * max_tokens
        results.append({"seconds": seconds, "tok_per_s": tokens / seconds, "faults": faults})
    results[-1]["peak_rss_mib"] = peak_rss_mib()
    return results


def peak_rss_mib() -> int:
    """This process's peak resident memory (VmHWM): what retaining costs."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM"))
    return int(line.split()[1]) // 1024


def run_variant(name: str, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    config = json.dumps(
        {"dtype": args.dtype, "retain": VARIANTS[name], "runs": args.runs,
         "max_tokens": args.max_tokens, "seed": seed}
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, __file__, "--worker", config], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--pairs", type=int, default=3, help="processes per variant")
    ap.add_argument("--runs", type=int, default=6, help="runs per process (the first: warm-up)")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--out", default=None, help="write every run as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        c = json.loads(args.worker)
        print(json.dumps(worker(c["dtype"], c["retain"], c["runs"], c["max_tokens"], c["seed"])))
        return
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    peaks: dict[str, list[int]] = {name: [] for name in VARIANTS}
    for pair in range(args.pairs):
        order = list(VARIANTS) if pair % 2 == 0 else list(VARIANTS)[::-1]
        for name in order:
            runs = run_variant(name, args, seed=pair)[1:]
            measured[name] += runs
            peaks[name].append(runs[-1]["peak_rss_mib"])
            print(
                f"pair {pair + 1} {name:>6}: tok/s "
                + " ".join(f"{r['tok_per_s']:.0f}" for r in runs)
                + "; faults "
                + " ".join(str(r["faults"]) for r in runs)
                + f"; peak RSS {peaks[name][-1]} MiB",
                flush=True,
            )
    print(f"\n{args.dtype}, max_tokens {args.max_tokens}: medians over {args.pairs} processes")
    for name, runs in measured.items():
        print(
            f"  {name:>6}: {statistics.median(r['tok_per_s'] for r in runs):.0f} tok/s, "
            f"{statistics.median(r['faults'] for r in runs):.0f} faults per run "
            f"(max {max(r['faults'] for r in runs)}), peak RSS {max(peaks[name])} MiB"
        )
    ratio = statistics.median(r["tok_per_s"] for r in measured["retain"]) / statistics.median(
        r["tok_per_s"] for r in measured["glibc"]
    )
    print(f"  retain / glibc: {ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": measured, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
