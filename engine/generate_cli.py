"""`kvpilot generate`: the engine offline on a few chat prompts, for a first look at a model."""

from __future__ import annotations

import argparse
import logging
import time

from kvpilot.engine.cpu.threads import fit_threads_to_cpu_quota
from kvpilot.engine.llm import LLM
from kvpilot.engine.sampling_params import SamplingParams

DEFAULT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about Kubernetes.",
    "Explain in two sentences what a KV cache is.",
    "Give me three tips for writing clear error messages.",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot generate", description=__doc__)
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    fit_threads_to_cpu_quota()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_enable_prefix_caching,
    )
    questions = args.prompt or DEFAULT_QUESTIONS
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    started = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    num_tokens = 0
    for question, out in zip(questions, outputs, strict=True):
        completion = out.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"\n>>> {question}\n{completion.text.strip()}\n[{completion.finish_reason}]")
    print(
        f"\n{len(outputs)} requests, {num_tokens} tokens in {elapsed:.1f} s "
        f"({num_tokens / elapsed:.1f} tokens/s)"
    )
    return 0
