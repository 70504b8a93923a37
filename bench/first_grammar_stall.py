"""What the first constrained request does to the streams already running on a fresh server.

The first request with a grammar (response_format json_schema, tools, guided regex...) makes the
engine core load its grammar backend: the tokenizer's vocabulary, seconds of work. This script
starts a fresh `kvpilot serve` per variant per round, opens --streams free streaming completions,
and once each has streamed a few tokens sends one json_schema chat completion; it reports the free
streams' longest gap between two tokens while that request was in flight (against their median
gap before it), and that request's latency. --free-control sends the same request without its
response_format: the gap any new request's prefill makes. --warm --fields N measures a new wide
schema's compile on a server whose backend is loaded.

    python bench/first_grammar_stall.py --rounds 3 --baseline-src /tmp/base --json out.json

--baseline-src: a directory holding a `kvpilot` package (see bench/serve_startup.py); its
variant runs with it first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.processes import with_source
from serve_startup import serving

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "stars"],
    "additionalProperties": False,
}
TOKENS_BEFORE = 8  # each free stream's tokens before the constrained request goes


def wide_schema(num_fields: int) -> dict[str, Any]:
    """An object of num_fields pattern-checked strings: a grammar that takes long to compile
    (xgrammar, this VM: ~0.25 s for 20 fields, ~1.1 s for 100)."""
    fields = {
        f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{2,{5 + i % 7}}}-[0-9]{{3}}$"}
        for i in range(num_fields)
    }
    return {"type": "object", "properties": fields, "required": list(fields),
            "additionalProperties": False}  # fmt: skip


async def free_stream(http: httpx.AsyncClient, times: list[float], max_tokens: int) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())


async def constrained(
    http: httpx.AsyncClient, schema: dict[str, Any] | None
) -> tuple[float, float, dict[str, Any]]:
    """A chat completion under schema (None: none); when it was sent and answered, its choice."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Rate the film Alien as JSON."}],
        "max_tokens": 64,
        "temperature": 0,
    }
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        }
    sent = time.perf_counter()
    response = await http.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return sent, time.perf_counter(), response.json()["choices"][0]


async def one_round(url: str, args: argparse.Namespace) -> dict[str, Any]:
    schema = None if args.free_control else wide_schema(args.fields) if args.fields else SCHEMA
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        if args.warm:
            await constrained(http, SCHEMA)  # the backend loads now, not in the measured request
        times: list[list[float]] = [[] for _ in range(args.streams)]
        streams = [asyncio.create_task(free_stream(http, t, args.max_tokens)) for t in times]
        while min(len(t) for t in times) < TOKENS_BEFORE:
            await asyncio.sleep(0.01)
        sent, answered, choice = await constrained(http, schema)
        await asyncio.gather(*streams)
    if schema is not None and choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])  # the grammar held (the tests check the schema)
    before, during = [], []
    for t in times:
        for a, b in itertools.pairwise(t):
            if b <= sent:
                before.append(b - a)
            elif a < answered:  # a gap that overlaps the constrained request's life
                during.append(b - a)
    return {
        "itl_median_before_s": statistics.median(before),
        "max_gap_during_s": max(during),
        "constrained_latency_s": answered - sent,
    }


def run_variant(extra_path: str | None, log_path: Path, args: argparse.Namespace) -> dict:
    with serving(with_source(dict(os.environ), extra_path), log_path, timeout_s=300) as server:
        return asyncio.run(one_round(server.url, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--baseline-src", help="a directory holding the baseline's kvpilot package")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--warm",
        action="store_true",
        help="one constrained request first: measure a new grammar's compile, not the load",
    )
    parser.add_argument(
        "--fields", type=int, default=0, help="constrain with wide_schema(N), not a small schema"
    )
    parser.add_argument(
        "--free-control",
        action="store_true",
        help="the same chat request without response_format: what any new request costs",
    )
    args = parser.parse_args()
    variants: dict[str, str | None] = {"this": None}
    if args.baseline_src:
        variants = {"base": args.baseline_src, **variants}
    logs = Path(tempfile.mkdtemp(prefix="grammar-stall-"))
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            got = run_variant(variants[name], logs / f"{name}-{r}.log", args)
            rounds[name].append(got)
            print(f"round {r + 1}/{args.rounds} {name}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)  # fmt: skip
    print(f"\nmedians of {args.rounds} rounds (s); logs in {logs}")
    keys = list(next(iter(rounds.values()))[0])
    print("| variant | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for name, got in rounds.items():
        medians = [statistics.median(g[k] for g in got) for k in keys]
        print(f"| {name} | " + " | ".join(f"{m:.3f}" for m in medians) + " |")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
