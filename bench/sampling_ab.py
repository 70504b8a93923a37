"""Sampled decoding (temperature 1, the OpenAI API's default) through the engine with its
inverse-CDF draw against the exponential race it replaced, one engine in one process, the two
draws taking turns on the same requests.

The exponential race (argmax(p / E), one Exp(1) number per vocabulary entry and row) is put back
for its turns by swapping the sampler module's two draw functions; every request here is unseeded,
so the default generator is the only one it needs.

    python bench/sampling_ab.py --batch 16 64 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine import sampler as sampler_module


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


def run(llm: LLM, batch: int, input_len: int, output_len: int, seed: int) -> float:
    """Output tokens per second of `batch` random-token requests decoded together."""
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(vocab, (input_len,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
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
    args = p.parse_args()
    llm = LLM(dtype=args.dtype, max_num_seqs=max(args.batch), enable_prefix_caching=False)
    print(f"SmolLM2-135M {args.dtype}, {torch.get_num_threads()} threads, temperature 1")
    print(f"{'batch':>6}{'exp. race tok/s':>18}{'inverse CDF tok/s':>20}{'ratio':>8}  rounds")
    for batch in args.batch:
        run(llm, batch, args.input_len, 4, seed=0)  # warm-up at this batch size
        race, cdf = [], []
        for r in range(args.rounds):
            with exponential_race():
                race.append(run(llm, batch, args.input_len, args.output_len, seed=r))
            cdf.append(run(llm, batch, args.input_len, args.output_len, seed=r))
        ratios = " ".join(f"{b / a:.2f}" for a, b in zip(race, cdf, strict=True))
        old, new = statistics.median(race), statistics.median(cdf)
        print(f"{batch:>6}{old:>18.1f}{new:>20.1f}{new / old:>7.2f}x  {ratios}")


if __name__ == "__main__":
    main()
