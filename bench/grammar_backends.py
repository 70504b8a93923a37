"""Which grammar library to constrain decoding with: xgrammar, llguidance or outlines-core, measured
on the bundled SmolLM2 tokenizer (vocabulary 49152) on this machine's CPU.

For each library and each schema: the first compile (tokenizer setup excluded, reported apart), and
the per-token cost of computing the next-token mask and advancing the matcher along a valid
document (the work a decode step adds per constrained sequence).

    python bench/grammar_backends.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvpilot.engine.model.loader import load_tokenizer, resolve_model

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "temperature": {"type": "number", "minimum": -90, "maximum": 60},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "forecast": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "day": {"type": "string"},
                            "high": {"type": "integer", "minimum": -90, "maximum": 60},
                        },
                        "required": ["day", "high"],
                        "additionalProperties": False,
                    },
                    "maxItems": 7,
                },
            },
            "required": ["city", "temperature", "unit", "forecast"],
            "additionalProperties": False,
        },
        {
            "city": "Paris",
            "temperature": 21.5,
            "unit": "celsius",
            "forecast": [{"day": "Monday", "high": 23}, {"day": "Tuesday", "high": 19}],
        },
    ),
}


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def bench_xgrammar(tokenizer: Any, schema: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    setup, info = _time(
        lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compile_s, compiled = _time(lambda: compiler.compile_json_schema(json.dumps(schema)))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for t in tokens:
        dt, _ = _time(lambda: matcher.fill_next_token_bitmask(bitmask))
        assert matcher.accept_token(t), t
        steps.append(dt)
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": statistics.median(steps) * 1e6}


def bench_llguidance(tokenizer: Any, schema: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    setup, lltok = _time(lambda: llguidance.hf.from_tokenizer(tokenizer))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    compile_s, matcher = _time(lambda: llguidance.LLMatcher(lltok, grammar))
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    steps = []
    for t in tokens:
        dt, _ = _time(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0))
        assert matcher.consume_token(t), (t, matcher.get_error())
        steps.append(dt)
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": statistics.median(steps) * 1e6}


def bench_outlines_core(
    tokenizer: Any, schema: dict[str, Any], tokens: list[int]
) -> dict[str, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary() -> Any:
        # Vocabulary.from_pretrained fetches from the hub; build it from the local tokenizer.
        by_string: dict[str, list[int]] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id == tokenizer.eos_token_id:
                continue
            text = tokenizer.convert_tokens_to_string([token])
            by_string.setdefault(text, []).append(token_id)
        return Vocabulary(tokenizer.eos_token_id, by_string)

    setup, vocab = _time(vocabulary)
    regex = build_regex_from_schema(json.dumps(schema))
    compile_s, index = _time(lambda: Index(regex, vocab))
    guide = Guide(index)
    steps = []
    for t in tokens:
        dt, allowed = _time(lambda: guide.get_tokens())
        assert t in allowed, t
        guide.advance(t)
        steps.append(dt)
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": statistics.median(steps) * 1e6}


BACKENDS = {
    "xgrammar": bench_xgrammar,
    "llguidance": bench_llguidance,
    "outlines-core": bench_outlines_core,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(resolve_model(None, "auto").hf_dir)
    print(f"vocabulary {len(tokenizer)}")
    print(f"{'backend':<14} {'schema':<8} {'setup s':>8} {'compile s':>10} {'mask us/token':>14}")
    for name, bench in BACKENDS.items():
        for schema_name, (schema, example) in SCHEMAS.items():
            tokens = tokenizer.encode(json.dumps(example), add_special_tokens=False)
            try:
                runs = [bench(tokenizer, schema, tokens) for _ in range(args.repeat)]
            except Exception as exc:  # a library that cannot do it is a finding, not a crash
                print(f"{name:<14} {schema_name:<8} failed: {type(exc).__name__}: {exc}")
                continue
            cell = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(
                f"{name:<14} {schema_name:<8} {cell['setup_s']:>8.2f} {cell['compile_s']:>10.3f} "
                f"{cell['mask_us']:>14.0f}"
            )


if __name__ == "__main__":
    main()
