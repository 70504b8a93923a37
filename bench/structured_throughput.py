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

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.loader import load_tokenizer, resolve_model
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


def first_compile_seconds() -> float:
    """A fresh backend (tokenizer vocabulary loaded first, not timed) compiling SCHEMA once."""
    tokenizer = load_tokenizer(resolve_model(None, "auto").hf_dir)
    backend = XGrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    started = time.perf_counter()
    backend.compile_spec(StructuredSpec.json_schema(SCHEMA))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    compile_s = first_compile_seconds()
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
        "first_compile_s": round(compile_s, 3),
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
