"""Sampled decoding through the engine, one engine in one process, two sampler variants taking
turns on the same requests:

- `--compare draw` (temperature 1, the OpenAI API's default): the inverse-CDF draw against the
  exponential race it replaced (argmax(p / E), one Exp(1) number per vocabulary entry and row), put
  back for its turns by swapping the sampler module's two draw functions; every request here is
  unseeded, so the default generator is the only one it needs.
- `--compare top_p` (temperature 0.7, top_p 0.9): the top-p filter's candidates against the full
  stable sort (TOP_P_CANDIDATES emptied for its turns).

    python bench/sampling_ab.py --batch 16 64 --rounds 3
    python bench/sampling_ab.py --compare top_p --batch 16 64 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine import sampler as sampler_module


@contextmanager
def full_sort() -> Iterator[None]:
    saved = sampler_module.TOP_P_CANDIDATES
    sampler_module.TOP_P_CANDIDATES = ()
    try:
        yield
    finally:
        sampler_module.TOP_P_CANDIDATES = saved


@contextmanager
def exponential_race() -> Iterator[None]:
    draw, pick = sampler_module._draw_uniforms, sampler_module.inverse_cdf

    def default_generator(generators: list[Any], default: torch.Generator, device: Any) -> Any:
        assert all(g is None for g in generators), "the race is put back for unseeded rows only"
        return default

    def race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return (probs / noise).max(-1).indices

    sampler_module._draw_uniforms, sampler_module.inverse_cdf = default_generator, race
    try:
        yield
    finally:
        sampler_module._draw_uniforms, sampler_module.inverse_cdf = draw, pick


def run(
    llm: LLM, batch: int, input_len: int, output_len: int, seed: int, params: SamplingParams
) -> float:
    """Output tokens per second of `batch` random-token requests decoded together."""
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(vocab, (input_len,), generator=gen).tolist() for _ in range(batch)]
    params = dataclasses.replace(params, max_tokens=output_len)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == batch * output_len
    return produced / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compare", choices=("draw", "top_p"), default="draw")
    args = p.parse_args()
    llm = LLM(dtype=args.dtype, max_num_seqs=max(args.batch), enable_prefix_caching=False)
    if args.compare == "draw":
        params = SamplingParams(temperature=1.0, ignore_eos=True)
        before, labels = exponential_race, ("exp. race", "inverse CDF")
    else:
        params = SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True)
        before, labels = full_sort, ("full sort", "candidates")
    print(f"SmolLM2-135M {args.dtype}, {torch.get_num_threads()} threads, {params}")
    print(f"{'batch':>6}{labels[0] + ' tok/s':>18}{labels[1] + ' tok/s':>20}{'ratio':>8}  rounds")
    for batch in args.batch:
        run(llm, batch, args.input_len, 4, 0, params)  # warm-up at this batch size
        old_runs, new_runs = [], []
        for r in range(args.rounds):
            with before():
                old_runs.append(run(llm, batch, args.input_len, args.output_len, r, params))
            new_runs.append(run(llm, batch, args.input_len, args.output_len, r, params))
        ratios = " ".join(f"{b / a:.2f}" for a, b in zip(old_runs, new_runs, strict=True))
        old, new = statistics.median(old_runs), statistics.median(new_runs)
        print(f"{batch:>6}{old:>18.1f}{new:>20.1f}{new / old:>7.2f}x  {ratios}")


if __name__ == "__main__":
    main()
