"""The batched sampler against the per-row one it replaced (kept as reference_sample in
tests/engine/test_sampler_batched.py), on SmolLM2's vocabulary with a mix of parameters; then the
draw alone: inverse-CDF sampling (one uniform per row) against the exponential race it replaced
(argmax(p / E), one Exp(1) draw per vocabulary entry), on the same filtered probabilities; then
the top-p filter with its candidates (the top 256, then 4096 tokens) against the full stable sort
(TOP_P_CANDIDATES emptied), on flat random logits and on peaked ones (40 tokens raised by 12, as
a model's next-token distribution usually is).

    python bench/sampler_bench.py --batch 32 64 --repeats 10 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "engine"))
from sampling_ab import exponential_race, full_sort
from test_sampler_batched import reference_sample

from kvpilot.engine import sampler as sampler_module
from kvpilot.engine.sampler import SampleResult, SamplerRow, filter_logits, sample
from kvpilot.engine.sampling_params import SamplingParams

VOCAB = 49152

# What a serving batch might hold: greedy chat, OpenAI-style sampling, seeded requests, penalties,
# logprobs.
MIX = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50, seed=1),
    SamplingParams(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05),
    SamplingParams(temperature=0.0, frequency_penalty=0.5, logprobs=5),
    SamplingParams(temperature=1.0, presence_penalty=0.6, seed=2),
    SamplingParams(temperature=0.9, min_p=0.1, logprobs=1),
    SamplingParams(temperature=1.0),
]

Sampler = Callable[[torch.Tensor, list[SamplerRow], torch.Generator], SampleResult]


def make_rows(batch: int, mix: list[SamplingParams]) -> list[SamplerRow]:
    rows = []
    for i in range(batch):
        p = mix[i % len(mix)]
        generator = None if p.seed is None else torch.Generator().manual_seed(p.seed + i)
        history = torch.randint(VOCAB, (200,), generator=torch.Generator().manual_seed(i)).tolist()
        rows.append(SamplerRow(p, history, generator))
    return rows


def time_ms(
    fns: list[Sampler], logits: torch.Tensor, rows: list[SamplerRow], repeats: int
) -> list[float]:
    """Median CPU ms (process time, all threads) per call of each sampler, the samplers taking
    turns: CPU time rather than wall time, and turns, so that a machine shared with other work
    still compares them fairly."""
    default = torch.Generator().manual_seed(0)
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn(logits, rows, default)  # warm-up
    for _ in range(repeats):
        for fn, t in zip(fns, times, strict=True):
            start = time.process_time()
            fn(logits, rows, default)
            t.append(time.process_time() - start)
    return [statistics.median(t) * 1e3 for t in times]


def inverse_cdf_draw(
    logits: torch.Tensor, rows: list[SamplerRow], default: torch.Generator
) -> torch.Tensor:
    """The draw alone, through the sampler module's functions (which exponential_race swaps)."""
    probs = filter_logits(logits, [r.params for r in rows]).softmax(-1)
    generators = [None] * len(rows)
    return sampler_module.inverse_cdf(
        probs, sampler_module._draw_uniforms(generators, default, probs.device)
    )


def exponential_race_draw(
    logits: torch.Tensor, rows: list[SamplerRow], default: torch.Generator
) -> torch.Tensor:
    """The draw the sampler used before: argmax(p / E), E ~ Exp(1) per entry (unseeded rows)."""
    with exponential_race():
        return inverse_cdf_draw(logits, rows, default)


def candidates_filter(
    logits: torch.Tensor, rows: list[SamplerRow], default: torch.Generator
) -> torch.Tensor:
    return filter_logits(logits, [r.params for r in rows])


def full_sort_filter(
    logits: torch.Tensor, rows: list[SamplerRow], default: torch.Generator
) -> torch.Tensor:
    with full_sort():
        return filter_logits(logits, [r.params for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {VOCAB}")
    workloads = {
        "mixed": MIX,
        "all greedy": [SamplingParams(temperature=0.0)],
        "all top_p 0.9": [SamplingParams(temperature=0.7, top_p=0.9)],
        "top_k 50+top_p": [SamplingParams(temperature=0.7, top_k=50, top_p=0.95)],
        "all seeded T=1": [SamplingParams(temperature=1.0, seed=0)],
    }
    tables = [
        ("workload", ("per-row cpu ms", "batched cpu ms"), [reference_sample, sample]),
        (
            "draw (T=1)",
            ("exp. race ms", "inverse CDF ms"),
            [exponential_race_draw, inverse_cdf_draw],
        ),
        ("top-p filter", ("full sort ms", "candidates ms"), [full_sort_filter, candidates_filter]),
    ]
    for (title, labels, fns), cases in zip(
        tables, [workload_cases, draw_cases, top_p_cases], strict=True
    ):
        print(f"\n{title:<22}{'batch':>6}{labels[0]:>16}{labels[1]:>16}{'speed-up':>10}")
        for batch in args.batch:
            for name, logits, mix in cases(batch, workloads):
                old, new = time_ms(fns, logits, make_rows(batch, mix), args.repeats)
                print(f"{name:<22}{batch:>6}{old:>16.2f}{new:>16.2f}{old / new:>9.2f}x")


Case = tuple[str, torch.Tensor, list[SamplingParams]]


def random_logits(batch: int) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3


def workload_cases(batch: int, workloads: dict[str, list[SamplingParams]]) -> list[Case]:
    logits = random_logits(batch)
    return [(name, logits, mix) for name, mix in workloads.items()]


def draw_cases(batch: int, _: object) -> list[Case]:
    return [("draw (T=1)", random_logits(batch), [SamplingParams(temperature=1.0)])]


def top_p_cases(batch: int, _: object) -> list[Case]:
    flat = random_logits(batch)
    peaked = flat.clone()
    peaked[:, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:40]] += 12
    top_p = [SamplingParams(temperature=0.7, top_p=0.9)]
    return [
        ("top_p 0.9, flat", flat, top_p),
        ("top_p 0.9, peaked", peaked, top_p),
        ("top_k 50 + top_p 0.95", flat, [SamplingParams(temperature=0.7, top_k=50, top_p=0.95)]),
    ]


if __name__ == "__main__":
    main()
