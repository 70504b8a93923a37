"""The speculation back-off on mixed batches (engine/spec_decode/policy.py), this build beside
another (--baseline-src), rounds alternating, each round a fresh process per build.

Two workloads at max_num_seqs 8, greedy, n-gram speculation (bench/spec_decode.py's config):
  beside   one request with a prediction (OpenAI's Predicted Outputs: the answer the same request
           gave before) among 7 free-writing ones whose proposals mostly miss: the predicted
           request's ITL, in the first batch and in the later ones (REPEATS batches per process).
  mixed    4 requests that copy a paragraph and 4 free-writing ones: each kind's mean ITL, and
           the proposals made and accepted.
ITL as bench/spec_decode.py measures it: (last token - first token) / (tokens - 1).

    .venv/bin/python bench/spec_backoff_mix.py --rounds 3 --baseline-src /tmp/base \
        --out bench/spec_backoff_mix.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common.processes import with_source
from spec_decode import (
    NGRAM_CONFIG,
    PARAGRAPHS,
    chat_prompts,
    itl_s,
    run_facts,
    with_prediction,
)

FREE = [f"Write a short story about {t}." for t in
        ("a dragon", "a robot", "the sea", "a market", "a cat", "a train", "a forest")]  # fmt: skip
PREDICTED = "Write three sentences about a lighthouse keeper."
MAX_TOKENS = 96
# Batches of each workload per process, one after another: the engine's acceptance carries over
# from batch to batch, as a server's does from request to request.
REPEATS = 3


def measure() -> dict[str, float]:
    """One round of both workloads in this process, with the kvpilot on its path."""
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.config import SpeculativeConfig
    from kvpilot.engine.outputs import RequestOutput

    llm = LLM(
        dtype="float32", max_num_seqs=8, speculative=SpeculativeConfig.from_json(NGRAM_CONFIG)
    )

    def chat(task: str) -> str:
        return chat_prompts(llm, [task])[0]

    def itl_ms(out: RequestOutput) -> float:
        itl = itl_s(out)
        assert itl is not None, "a request of under two tokens"
        return itl * 1000

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    answer = llm.generate([chat(PREDICTED)], params)[0].outputs[0].text  # also the warm-up
    predicted = with_prediction(params, llm.tokenizer, answer)
    counters = llm.engine.core.speculation.counters
    beside = []
    for _ in range(REPEATS):
        llm.engine.core.block_manager.reset_prefix_cache()
        outs = llm.generate([chat(PREDICTED), *map(chat, FREE)], [predicted] + [params] * len(FREE))
        beside.append(itl_ms(outs[0]))
    copy = [f"Repeat this text exactly: {p}" for p in PARAGRAPHS]
    mixed: dict[str, list[float]] = {"copy": [], "free": [], "proposed": [], "accepted": []}
    for _ in range(REPEATS):
        llm.engine.core.block_manager.reset_prefix_cache()
        drafted, accepted = counters.num_draft_tokens, counters.num_accepted_tokens
        outs = llm.generate([*map(chat, copy), *map(chat, FREE[:4])], params)
        mixed["copy"].append(statistics.mean(itl_ms(o) for o in outs[:4]))
        mixed["free"].append(statistics.mean(itl_ms(o) for o in outs[4:]))
        mixed["proposed"].append(counters.num_draft_tokens - drafted)
        mixed["accepted"].append(counters.num_accepted_tokens - accepted)
    return {
        "beside: predicted request ITL ms, first batch": beside[0],
        "beside: predicted request ITL ms, later batches": statistics.mean(beside[1:]),
        "mixed: copy ITL ms": statistics.mean(mixed["copy"]),
        "mixed: free ITL ms": statistics.mean(mixed["free"]),
        "mixed: proposed tokens per batch": statistics.mean(mixed["proposed"]),
        "mixed: accepted tokens per batch": statistics.mean(mixed["accepted"]),
    }


def run_child(src: str | None) -> dict[str, float]:
    env = with_source(dict(os.environ), src)
    out = subprocess.run(
        [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-src", help="a directory holding the baseline's kvpilot package")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()), flush=True)
        return
    builds = {"this build": None, **({"base": args.baseline_src} if args.baseline_src else {})}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for r in range(args.rounds):
        for name in builds if r % 2 == 0 else list(reversed(builds)):
            got = run_child(builds[name])
            rounds[name].append(got)
            print(f"round {r + 1} {name}: {json.dumps(got)}", flush=True)
    medians = {
        name: {k: round(statistics.median(g[k] for g in got), 2) for k in got[0]}
        for name, got in rounds.items()
    }
    for name, m in medians.items():
        print(f"median {name}: {json.dumps(m)}")
    if args.out is not None:
        report = {
            "command": f"python bench/spec_backoff_mix.py --rounds {args.rounds}"
            + (f" --baseline-src {args.baseline_src}" if args.baseline_src else ""),
            **run_facts(),
            "speculative_config": NGRAM_CONFIG,
            "rounds": rounds,
            "medians": medians,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
