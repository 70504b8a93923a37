"""Tensor parallelism on CPU: TP=1 against TP=2 on the same cores, and TP=1 of this checkout
against TP=1 of another (the baseline: did the TP plumbing slow the single-device path?).

On one machine the ranks share the cores (each rank gets cores / N torch threads), so TP=2 is a
correctness-and-overhead figure, not a speedup: what the per-step StepInput send and the three
collectives per layer (two all-reduces and, at the end, the logits gather) cost over gloo.

Each variant runs in a fresh process, the variants alternate for --rounds rounds, and the median
round is reported (the machine may be shared). Model: a random Llama of a small real shape saved
with transformers (8 query heads, 4 KV heads, 8 layers, hidden 512, vocab 32000, tied; ~41M
parameters), since SmolLM2's 9 heads do not split in two. Workload: --num-requests prompts of
60-220 random token ids, each output forced to its length with ignore_eos; greedy tokens are
compared between variants.

    python bench/tp_overhead.py --variants tp1,tp1@1,tp2 --rounds 3
    python bench/tp_overhead.py --variants base-tp1,tp1 --baseline-src /tmp/base --rounds 3

--baseline-src is a directory holding a `kvpilot` package whose `engine` is the baseline's
(e.g. `git archive main engine cli | tar -x -C /tmp/base/kvpilot`); it is put first on PYTHONPATH
for the base-* variants.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def save_model(path: Path) -> None:
    """A random Llama of a small real shape whose heads split in two: 8 query heads, 4 KV heads
    (SmolLM2's 9 heads split only in 3 or 9)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=True, initializer_range=0.1,  # peaky logits: no greedy near-ties
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(32000) for _ in range(rng.randint(60, 220))]
        for _ in range(args.num_requests)
    ]
    return prompts, [rng.randint(args.min_out, args.max_out) for _ in prompts]


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    """In this (fresh) process: load, warm up, time one generate over the workload."""
    import torch

    from kvpilot.engine import LLM, SamplingParams

    tp = int(variant.split("@")[0].rsplit("tp", 1)[1])
    kwargs = {"tensor_parallel_size": tp} if tp > 1 else {}
    llm = LLM(
        model=args.model_dir, dtype=args.dtype, max_num_seqs=args.max_batch, kv_cache_gib=0.25,
        **kwargs,
    )  # fmt: skip
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([[1, 2, 3, 4, 5] * 20, [7, 8, 9] * 30], warm)
    prompts, lengths = workload(args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    if hasattr(llm, "shutdown"):
        llm.shutdown()
    return {
        "variant": variant,
        "threads_per_rank": torch.get_num_threads(),
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in tokens),
        "tokens_per_s": sum(len(t) for t in tokens) / seconds,
        "tokens": tokens,
    }


def spawn(variant: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if "@" in variant:  # tp1@1: the whole engine limited to 1 torch thread
        env["OMP_NUM_THREADS"] = variant.split("@")[1]
    if variant.startswith("base-"):
        if not args.baseline_src:
            raise SystemExit("base-* variants need --baseline-src")
        env["PYTHONPATH"] = os.pathsep.join([args.baseline_src, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--run", variant, "--model-dir", args.model_dir,
           "--dtype", args.dtype, "--num-requests", str(args.num_requests),
           "--min-out", str(args.min_out), "--max-out", str(args.max_out),
           "--max-batch", str(args.max_batch), "--seed", str(args.seed)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--variants",
        default="tp1,tp2",
        help="tpN or base-tpN, optionally @T for T torch threads in all (split over the ranks)",
    )
    ap.add_argument("--baseline-src", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--min-out", type=int, default=32)
    ap.add_argument("--max-out", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None, help="default: a random model in a temp dir")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_variant(args.run, args)))
        return
    if args.model_dir is None:
        args.model_dir = tempfile.mkdtemp(prefix="tp-bench-")
        save_model(Path(args.model_dir))
    variants = args.variants.split(",")
    rounds: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            result = spawn(v, args)
            rounds[v].append(result)
            print(f"round {r + 1} {v}: {result['tokens_per_s']:.1f} tok/s "
                  f"({result['seconds']:.2f} s, {result['threads_per_rank']} threads/rank)",
                  flush=True)  # fmt: skip
    first = rounds[variants[0]][0]["tokens"]
    for v in variants:
        same = all(res["tokens"] == first for res in rounds[v])
        rates = [res["tokens_per_s"] for res in rounds[v]]
        print(
            f"{v}: median {statistics.median(rates):.1f} tok/s over {len(rates)} rounds "
            f"{[round(x, 1) for x in rates]}; greedy tokens identical to {variants[0]}: {same}"
        )


if __name__ == "__main__":
    main()
