"""Output tokens/s with a JSON schema on every request against the same requests unconstrained, on
the bundled SmolLM2 (offline LLM, one process), batch --batch, in one run; plus the first request's
grammar compile time.

Every request produces exactly --max-tokens tokens in every variant, so the batch stays full and
only the per-token cost differs: unconstrained rows ignore EOS, and the schema asks for a list of
at least 64 small objects, which no request can finish within --max-tokens. Variants alternate for
--repeats rounds (the shared VM drifts between runs) and each one's median round is reported:

- free: no constraint;
- json: json_schema on every request, masks filled on a thread while the forward runs (default);
- json-serial: the same, masks filled after the forward.

    python bench/structured_throughput.py --batch 32 --max-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.loader import load_tokenizer, resolve_model
from kvpilot.engine.structured.bitmask import apply_bitmask
from kvpilot.engine.structured.spec import StructuredSpec
from kvpilot.engine.structured.xgrammar_backend import XGrammarBackend

SCHEMA = {
    "type": "object",
    "properties": {
        "report": {"type": "string", "maxLength": 24},
        "readings": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "station": {"enum": ["north", "south", "east", "west"]},
                    "celsius": {"type": "number", "minimum": -50, "maximum": 60},
                    "ok": {"type": "boolean"},
                },
                "required": ["station", "celsius", "ok"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["report", "readings"],
    "additionalProperties": False,
}
TOPICS = ["Paris", "Oslo", "Lima", "Cairo", "Perth", "Quito", "Seoul", "Dakar"]


def grammar_costs(batch: int) -> dict[str, float]:
    """A fresh backend (tokenizer vocabulary loaded first, not timed) compiling SCHEMA once; then,
    with `batch` matchers inside a document, one step's mask work: filling every row, and applying
    the masks to [batch, V] logits (medians of 30)."""
    tokenizer = load_tokenizer(resolve_model(None, "auto").hf_dir)
    backend = XGrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    started = time.perf_counter()
    compiled = backend.compile_spec(StructuredSpec.json_schema(SCHEMA))
    compile_s = time.perf_counter() - started
    prefix = '{"report": "calm", "readings": [{"station": "north", "celsius": 12.5, "ok": true}, '
    matchers = [backend.matcher(compiled) for _ in range(batch)]
    for m in matchers:
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert m.accept(token)
    bitmask = backend.allocate_bitmask(batch)
    logits = torch.randn(batch, backend.vocab_size)
    rows = list(range(batch))

    def median_ms(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(30):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    fill_ms = median_ms(lambda: [m.fill_mask(bitmask, i) for i, m in enumerate(matchers)])
    apply_ms = median_ms(lambda: apply_bitmask(logits.clone(), bitmask, rows))
    clone_ms = median_ms(logits.clone)
    return {
        "first_compile_s": round(compile_s, 3),
        "mask_fill_ms": round(fill_ms, 3),
        "mask_apply_ms": round(apply_ms - clone_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    costs = grammar_costs(args.batch)
    llm = LLM(max_num_seqs=args.batch, kv_cache_gib=0.25)
    prompts = [
        [{"role": "user", "content": f"Weather readings for {TOPICS[i % len(TOPICS)]}, #{i}."}]
        for i in range(args.batch)
    ]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, structured=StructuredSpec.json_schema(SCHEMA)
    )
    core = llm.engine.core

    def run(name: str) -> float:
        core.structured.overlap = name != "json-serial"
        params = free if name == "free" else constrained
        llm.engine.reset_prefix_cache()  # every round prefills the same way
        started = time.perf_counter()
        outs = llm.chat(prompts, params)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == args.batch * args.max_tokens, tokens  # a full batch all the way
        return tokens / elapsed

    started = time.perf_counter()
    llm.chat(
        prompts[:1],
        SamplingParams(temperature=0.0, max_tokens=1, structured=constrained.structured),
    )
    first_request_s = time.perf_counter() - started  # the core's first constrained request
    run("free")  # warm-up of the batch shapes
    variants = ("free", "json", "json-serial")
    rounds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            rounds[v].append(run(v))
    medians = {v: statistics.median(r) for v, r in rounds.items()}
    result = {
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        **costs,
        "first_constrained_request_s": round(first_request_s, 3),
        "tok_s_rounds": {v: [round(x, 1) for x in r] for v, r in rounds.items()},
        "tok_s_median": {v: round(x, 1) for v, x in medians.items()},
        "json_vs_free": round(medians["json"] / medians["free"], 3),
        "json_serial_vs_free": round(medians["json-serial"] / medians["free"], 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
